"""Dry runs summed without a plan (zeroshard.toolkit.plan_summary) print what the plan prints.

`reshard --dry-run` and `consolidate --dry-run` sum the rows a plan is cut from instead of
materializing its pieces (a 405B reshard from 16,384 ranks has ~100 million); on random layouts,
in blocks as small as one output, the text must be Plan.describe()'s, character for character.
"""

from __future__ import annotations

import random

import pytest
from test_plan import random_checkpoint

from zeroshard.format import open_checkpoint
from zeroshard.partition import floor_sum, holders, shard_range, span_overlaps
from zeroshard.toolkit import plan_summary
from zeroshard.toolkit.plan import make_plan, plan_files
from zeroshard.toolkit.selection import model_tensors, output_files

TIER = "default"  # docs/TESTING.md


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("block", [1, 7, 1 << 20])
def test_summed_dry_runs_print_the_plans_text(tmp_path, monkeypatch, seed, block):
    monkeypatch.setattr(plan_summary, "ROWS_PER_BLOCK", block)
    rng = random.Random(seed)
    world, _ = random_checkpoint(rng, str(tmp_path / "ck"))
    _, manifest = open_checkpoint(str(tmp_path / "ck"))
    for to in sorted({1, world, world + 1, rng.randint(1, 13), max(world - 1, 1)}):
        for limit in (2, 10):
            assert plan_summary.describe_reshard(manifest, to, limit=limit) == \
                make_plan(manifest, to).describe(limit), (to, limit)
    for out, dtype, shard in (("m.safetensors", None, None), ("m.safetensors", "bf16", None),
                              ("hf", None, "64B"), ("hf", "fp16", "16B")):
        names, shards, _ = output_files(out, model_tensors(out, manifest, dtype, None, None, None), shard)
        for limit in (2, 10):
            assert plan_summary.describe_files(manifest, names, shards, limit) == \
                plan_files(manifest, names, shards).describe(limit), (out, dtype, shard)


def test_floor_sum_is_the_sum_it_names():
    rng = random.Random(0)
    for _ in range(2000):
        n, m, a, b = rng.randint(0, 40), rng.randint(1, 60), rng.randint(0, 200), rng.randint(0, 200)
        assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n)), (n, m, a, b)
    big = 2**40 + 7  # beyond what int64 products survive: Python integers
    assert floor_sum(3, big, big * 5, big) == sum((big * 5 * i + big) // big for i in range(3))


def test_span_overlaps_counts_what_holders_lists():
    rng = random.Random(1)
    for _ in range(3000):
        numel, source, target = rng.choice([0, 1, 5, rng.randint(1, 300)]), rng.randint(1, 40), rng.randint(1, 40)
        first = rng.randint(0, target)
        end = rng.randint(first, target)
        pairs, elements, ranks = 0, 0, set()
        for r in range(first, end):
            start, stop = shard_range(numel, target, r)
            found = holders(numel, source, start, stop)
            pairs, elements = pairs + len(found), elements + stop - start
            ranks.update(rank for rank, _ in found)
        got = span_overlaps(numel, source, target, first, end)
        spanned = set(range(*got[2]))
        assert (got[0], got[1], spanned) == (pairs, elements, ranks), (numel, source, target, first, end)
