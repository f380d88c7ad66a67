"""Two DeepSpeedExamples-style training scripts nobody adapted (samples/gpt_pretrain_deepspeed.py,
samples/bert_mlm_deepspeed.py: `import deepspeed`, dropout, their own save_checkpoint /
load_checkpoint) run on zeroshard.deepspeed with only the import pointed there
(samples/run_script.py), at world 2 on gloo, stages 1-3, fresh and resumed, and give real
DeepSpeed 0.19.8's per-step losses (tests/data/deepspeed_examples/, made by
tools/make_deepspeed_example_references.py) within 1e-4 relative.

The resumed runs also pin DeepSpeed's resume semantics: load_checkpoint leaves the RNG streams
alone, so with dropout the resumed losses are not the uninterrupted run's (checked below)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from distributed import free_port

TIER = "slow"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "deepspeed_examples"
sys.path.insert(0, str(ROOT / "tools"))
from make_deepspeed_example_references import EXAMPLES, STAGES, run_example  # noqa: E402


def _close(a: list[float], b: list[float], rel: float = 1e-4) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel) for x, y in zip(a, b))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_script_gives_deepspeeds_losses_fresh_and_resumed(tmp_path, name):
    reference = json.loads((DATA / f"{name}.json").read_text())
    assert reference["deepspeed_version"] == "0.19.8" and reference["script"] == EXAMPLES[name][0]
    ours = run_example(name, "zeroshard", tmp_path, free_port(), timeout=300)
    for stage in STAGES:
        theirs, got = reference["losses"][f"stage{stage}"], ours[f"stage{stage}"]
        for rank in range(reference["world_size"]):
            for kind in ("fresh", "resumed"):
                assert _close(got[kind][rank], theirs[kind][rank]), (stage, rank, kind, got[kind][rank],
                                                                     theirs[kind][rank])
            # dropout + RNG left alone by load_checkpoint: the resumed steps differ from the
            # uninterrupted run's (they would equal them had the RNG been restored)
            fresh_tail = got["fresh"][rank][-len(got["resumed"][rank]):]
            assert not _close(got["resumed"][rank], fresh_tail, rel=1e-6)


def test_scripts_name_only_deepspeed():
    """Nothing in the scripts refers to zeroshard: the runner's import alias is the only change."""
    for script, _, _ in EXAMPLES.values():
        code = (ROOT / script).read_text().split('"""', 2)[2]
        assert "zeroshard" not in code and "import deepspeed" in code


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_references_are_what_real_deepspeed_gives_now(tmp_path):
    """The committed references still match a live DeepSpeed run (one script, to keep this short),
    within 1e-5 relative, this project's fp32 bar: real DeepSpeed's own losses differ from run to
    run and machine to machine in the last bits (measured: about 1.1e-7 relative, in a different
    step each run, on the same machine and code), so bit equality failed on unchanged code."""
    reference = json.loads((DATA / "bert_mlm.json").read_text())
    live = run_example("bert_mlm", "deepspeed", tmp_path, free_port(), timeout=300)
    assert sorted(live) == sorted(reference["losses"])
    for stage, runs in reference["losses"].items():
        assert sorted(live[stage]) == sorted(runs)
        for kind, per_rank in runs.items():
            assert len(live[stage][kind]) == len(per_rank)
            for rank, losses in enumerate(per_rank):
                assert _close(live[stage][kind][rank], losses, rel=1e-5), (stage, kind, rank, live[stage][kind][rank],
                                                                            losses)
