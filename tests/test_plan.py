"""The planner (zeroshard.toolkit.plan) against the partition rule, on random layouts.

Each plan is carried out here by a deliberately naive executor (read each piece's bytes from
its input file, cast, drop them at the output offset) and checked byte by byte: every output
tensor byte is written exactly once, from the right input byte, and nothing else is written.
Expected places come from the per-rank scalar planner (plans.RankFilePlans / plan_output) and
expected values from zeroshard.partition over the global tensors read back by CheckpointReader.
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from zeroshard.format import TensorSpec, open_checkpoint
from zeroshard.partition import shard_range
from zeroshard.storage.safetensors_header import parse_header, torch_dtype
from zeroshard.toolkit.plan import make_plan

from checkpoints import read_checkpoint, write_checkpoint

TIER = "default"  # docs/TESTING.md

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64, "U8": torch.uint8}


def random_checkpoint(rng: random.Random, url: str) -> tuple[int, dict[str, torch.Tensor]]:
    specs, data = [], {}
    for i in range(rng.randint(1, 7)):
        dtype = rng.choice(list(DTYPES))
        shape = rng.choice([(), (0,), (1,), (rng.randint(1, 40),), (rng.randint(1, 9), rng.randint(1, 9))])
        layout = "whole" if shape == () or rng.random() < 0.2 else "flat"
        role = rng.choice(["param", "param", "buffer", "extra"])
        name = f"t{i}"
        value = (torch.randn(shape) * 100).to(DTYPES[dtype]) if DTYPES[dtype].is_floating_point \
            else torch.randint(0, 100, shape).to(DTYPES[dtype])
        specs.append(TensorSpec(name, role, dtype, shape, layout))
        data[name] = value
    if not any(s.role in ("param", "buffer") for s in specs):
        specs.append(TensorSpec("w", "param", "F32", (5,), "flat"))
        data["w"] = torch.arange(5.0)
    world = rng.randint(1, 9)
    write_checkpoint(url, specs, data, world, rng=rng.random() < 0.7)
    return world, read_checkpoint(url)


def carry_out(plan, folder) -> list[bytearray]:
    """The naive executor: returns every output's bytes and asserts each byte is written once."""
    outputs = [bytearray(size) for size in plan.output_sizes]
    coverage = [np.zeros(size, dtype=np.int64) for size in plan.output_sizes]
    inputs = {i: (folder / name).read_bytes() for i, name in enumerate(plan.input_names)}
    for k in range(len(plan)):
        data = inputs[int(plan.input[k])]
        # the plan's input layout is the one the writer really used
        header = parse_header(data[8:8 + int.from_bytes(data[:8], "little")], "input", len(data))
        entry = header.entries[plan.tensor_names[int(plan.tensor[k])]]
        assert entry.begin == int(plan.input_fragment[k])
        start = int(plan.input_offset[k])
        assert entry.begin <= start and start + int(plan.nbytes[k]) <= entry.end
        piece = bytes(data[start:start + int(plan.nbytes[k])])
        cast = plan.casts[int(plan.cast[k])]
        if cast is not None:
            values = torch.frombuffer(bytearray(piece), dtype=torch_dtype(cast[0])).to(torch_dtype(cast[1]))
            piece = values.view(torch.uint8).numpy().tobytes()
        at, out = int(plan.output_offset[k]), int(plan.output[k])
        assert len(piece) == int(plan.written[k])
        outputs[out][at:at + len(piece)] = piece
        coverage[out][at:at + len(piece)] += 1
    for i, cover in enumerate(coverage):
        expected = np.zeros_like(cover)
        for t in plan.outputs.plan(i).tensors:
            expected[t.begin:t.begin + t.nbytes] = 1
        assert (cover == expected).all(), f"output {i}: bytes written {cover.max()} times or left unwritten"
    return outputs


def element_bytes(tensor: torch.Tensor, dtype: str, start: int, end: int) -> bytes:
    flat = tensor.reshape(-1)[start:end].to(torch_dtype(dtype)).contiguous()
    return flat.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("seed", range(12))
def test_reshard_plans_write_every_byte_once_from_the_right_byte(tmp_path, seed):
    rng = random.Random(seed)
    world, tensors = random_checkpoint(rng, str(tmp_path / "ck"))
    _, manifest = open_checkpoint(str(tmp_path / "ck"))
    for target in {rng.randint(1, 12), world, 1}:
        plan = make_plan(manifest, target)
        assert [p.name for p in map(plan.outputs.plan, range(target))] == [
            f"rank-{r:05d}-of-{target:05d}.safetensors" for r in range(target)]
        outputs = carry_out(plan, tmp_path / "ck")
        for rank, out in enumerate(outputs):
            output = plan.outputs.plan(rank)
            assert plan.output_sizes[rank] == output.size
            for t in output.tensors:
                if t.source.layout == "flat":
                    assert (t.start, t.end) == shard_range(t.source.numel, target, rank)
                assert out[t.begin:t.begin + t.nbytes] == element_bytes(tensors[t.source.name], t.dtype, t.start, t.end)
        kept_local = {t.name for t in manifest.tensors.values() if t.layout == "local"} if target == world else set()
        written = {t.source.name for r in range(target) for t in plan.outputs.plan(r).tensors}
        assert written == {n for n, t in manifest.tensors.items() if t.numel and (t.layout != "local")} | {
            n for n in kept_local if manifest.tensors[n].numel}


@pytest.mark.parametrize("seed", range(12, 20))
def test_consolidate_plans_cast_select_and_place_whole_tensors(tmp_path, seed):
    rng = random.Random(seed)
    _, tensors = random_checkpoint(rng, str(tmp_path / "ck"))
    _, manifest = open_checkpoint(str(tmp_path / "ck"))
    dtype = rng.choice([None, "bf16", "fp32", "fp16"])
    names = [n for n, t in manifest.tensors.items() if t.role in ("param", "buffer")]
    exclude = [rng.choice(names)] if len(names) > 1 and rng.random() < 0.5 else None
    out = "model.safetensors" if rng.random() < 0.5 else "folder"
    plan = make_plan(manifest, out, dtype=dtype, exclude=exclude, max_shard_size=None if out.endswith("s") else "64B")
    outputs = carry_out(plan, tmp_path / "ck")
    seen = []
    for i, data in enumerate(outputs):
        for t in plan.outputs.plan(i).tensors:
            seen.append(t.name)
            floating = t.source.dtype in ("F32", "BF16", "F16")
            assert t.dtype == ({"bf16": "BF16", "fp32": "F32", "fp16": "F16"}[dtype] if dtype and floating
                               else t.source.dtype)
            assert data[t.begin:t.begin + t.nbytes] == element_bytes(tensors[t.source.name], t.dtype, 0, t.end)
    assert sorted(seen) == sorted(n for n in names if n not in (exclude or []))
    if out == "folder" and len(seen) > 1 and sum(manifest.tensors[n].nbytes for n in seen) > 64:
        assert len(outputs) > 1  # HF shards of at most 64 bytes (a bigger tensor alone)


def test_plans_are_pure_split_and_describe(tmp_path):
    _, _ = random_checkpoint(random.Random(99), str(tmp_path / "ck"))
    _, manifest = open_checkpoint(str(tmp_path / "ck"))
    shutil.rmtree(tmp_path / "ck")  # planning reads nothing but the manifest
    plan = make_plan(manifest, 7)
    assert len(plan) and plan.nbytes.sum() == sum(t.nbytes for t in manifest.tensors.values() if t.layout != "local")
    for k in (1, 2, 3, 7, 50):
        parts = plan.split(k)
        assert 1 <= len(parts) <= k
        assert sum(len(p) for p in parts) == len(plan)
        for column in ("input", "input_offset", "output", "output_offset", "nbytes"):
            assert (np.concatenate([getattr(p, column) for p in parts]) == getattr(plan, column)).all()
        owned = [set(p.outputs_used()) for p in parts]
        assert sum(len(o) for o in owned) == len(set().union(*owned))  # each output in one part only
        assert sum(sum(1 for s in p.output_sizes if s) for p in parts) == 7  # each part describes its own
    text = plan.describe()
    assert f"read {int(plan.nbytes.sum()):,} bytes" in text and "into 7 files" in text
    assert "rank-00000-of-00007.safetensors" in text
    with pytest.raises(ValueError):
        plan.split(0)


def test_split_by_pieces_shares_outputs_made_up_front(tmp_path, monkeypatch):
    """Plan.split(whole_outputs=False), for outputs created up front (one big consolidated file):
    consecutive runs of pieces, at most PIECE_BUDGET each, every part naming the outputs it writes."""
    from zeroshard.toolkit import plan as plan_module

    specs = [TensorSpec(f"t{i}", "param", "F32", (10 + i,), "flat") for i in range(6)]
    write_checkpoint(str(tmp_path / "ck"), specs, {s.name: torch.randn(s.shape) for s in specs}, 4)
    _, manifest = open_checkpoint(str(tmp_path / "ck"))
    for out, shard in (("model.safetensors", None), ("folder", "100B")):
        plan = make_plan(manifest, out, max_shard_size=shard)
        for k in (1, 2, 5, 1000):
            parts = plan.split(k, whole_outputs=False)
            assert 1 <= len(parts) <= k and sum(len(p) for p in parts) == len(plan)
            for column in ("input", "input_offset", "output", "output_offset", "nbytes"):
                assert (np.concatenate([getattr(p, column) for p in parts]) == getattr(plan, column)).all()
            for p in parts:
                assert [i for i, s in enumerate(p.output_sizes) if s] == p.outputs_used()
        monkeypatch.setattr(plan_module, "PIECE_BUDGET", 3)
        parts = plan.split(1, whole_outputs=False)
        assert max(len(p) for p in parts) <= 3 and sum(len(p) for p in parts) == len(plan)
        monkeypatch.undo()


def _tree(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    from click.testing import CliRunner

    from zeroshard.cli import main

    _, _ = random_checkpoint(random.Random(5), str(tmp_path / "ck"))
    _, manifest = open_checkpoint(str(tmp_path / "ck"))
    before = _tree(tmp_path)
    runs = {"reshard": ["reshard", str(tmp_path / "ck"), "--to", "3", "--dry-run"],
            "reshard-out": ["reshard", str(tmp_path / "ck"), str(tmp_path / "new"), "--to", "5", "--dry-run"],
            "file": ["consolidate", str(tmp_path / "ck"), str(tmp_path / "m.safetensors"), "--dry-run",
                     "--dtype", "bf16"],
            "folder": ["consolidate", str(tmp_path / "ck"), str(tmp_path / "hf"), "--dry-run",
                       "--max-shard-size", "64B"]}
    for what, args in runs.items():
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, (what, result.output)
        plan = (make_plan(manifest, int(args[args.index("--to") + 1])) if what.startswith("reshard")
                else make_plan(manifest, args[2], dtype="bf16" if what == "file" else None,
                               max_shard_size="64B" if what == "folder" else None))
        assert "nothing written" in result.output
        assert f"read {int(plan.nbytes.sum()):,} bytes from" in result.output
        assert f"into {sum(1 for s in plan.output_sizes if s)} files" in result.output
        assert _tree(tmp_path) == before, what  # no output, no claim, no stage, no temp file
    result = CliRunner().invoke(main, ["consolidate", str(tmp_path / "ck"), str(tmp_path / "o"), "--dry-run",
                                       "--include", "nothing*"])
    assert result.exit_code != 0 and "matches no tensor" in result.output  # checked as a real run would
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("window", [None, 64])
def test_the_copy_executor_carries_out_the_plan(tmp_path, monkeypatch, window):
    """reshard and consolidate move exactly the plan's pieces (small inputs read whole, or with
    a tiny window every input read side by side): a piece left out of the plan is left out."""
    from safetensors.torch import load_file

    from zeroshard.toolkit import plan as plan_module
    from zeroshard.toolkit import transfer
    from zeroshard.toolkit.consolidate import consolidate
    from zeroshard.toolkit.reshard import reshard

    if window:
        from zeroshard.toolkit import gather

        monkeypatch.setattr(transfer, "WINDOW_BYTES", window)
        monkeypatch.setattr(gather, "WHOLE_HASH_BYTES", 0)  # no input is read whole
    specs = [TensorSpec("w", "param", "F32", (40, 3), "flat"), TensorSpec("b", "param", "F32", (7,), "flat")]
    data = {"w": torch.randn(40, 3), "b": torch.randn(7)}
    write_checkpoint(str(tmp_path / "ck"), specs, data, 3)
    reshard(str(tmp_path / "ck"), 4, str(tmp_path / "r4"))
    assert read_checkpoint(str(tmp_path / "r4"))["w"].equal(data["w"])
    made = []
    original = plan_module.plan_file_parts

    def last_piece_dropped(*args, **kwargs):
        for plan in original(*args, **kwargs):  # a consolidate plans a part of its tensors at a time
            made.append(plan)
            keep = np.ones(len(plan), dtype=bool)
            of_w = np.flatnonzero(plan.tensor == plan.tensor_names.index("w"))
            if len(of_w):
                keep[of_w[-1]] = False
            yield plan.take(keep)

    monkeypatch.setattr(plan_module, "plan_file_parts", last_piece_dropped)
    consolidate(str(tmp_path / "ck"), str(tmp_path / "m.safetensors"))
    assert made and sum(int(p.nbytes.sum()) for p in made) == (120 + 7) * 4
    out = load_file(str(tmp_path / "m.safetensors"))
    assert out["b"].equal(data["b"])
    last = shard_range(120, 3, 2)  # the last piece of w: rank 2's fragment, never copied
    assert out["w"].reshape(-1)[:last[0]].equal(data["w"].reshape(-1)[:last[0]])
    assert (out["w"].reshape(-1)[last[0]:] == 0).all()


@pytest.mark.parametrize("seed", [3, 8])
def test_the_remote_executor_writes_the_local_executors_bytes_from_split_plans(tmp_path, seed):
    """stream.py (what S3 outputs and the torchrun mode use) carries out the plan's pieces, dealt
    out by Plan.split: the rank files are byte for byte those of the local executor."""
    import json

    from zeroshard.storage.location import Location
    from zeroshard.toolkit.plan import plan_rank_files
    from zeroshard.toolkit.reshard import reshard
    from zeroshard.toolkit.stream import stream_outputs

    world, _ = random_checkpoint(random.Random(seed), str(tmp_path / "ck"))
    to = world + 2
    reshard(str(tmp_path / "ck"), to, str(tmp_path / "local"))
    checkpoint_id = json.loads((tmp_path / "local" / "zeroshard.json").read_text())["id"]
    source, manifest = open_checkpoint(str(tmp_path / "ck"))
    plan = plan_rank_files(manifest, [t for t in manifest.tensors.values() if t.layout != "local"], to, checkpoint_id)
    target = Location(str(tmp_path / "remote"))
    target.makedirs()
    results = [r for part in plan.split(3) for r in stream_outputs(source, manifest, target, part)]
    names = sorted(p.name for p in (tmp_path / "local").glob("rank-*"))
    assert sorted(r.file.name for r in results) == names and len(names) == to
    for name in names:
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name
