"""A local reshard or consolidate never holds the pieces of every output at once: tasks of
consecutive rank files each plan their own (toolkit.plan.rank_file_tasks), a consolidate plans a
part of its tensors at a time (plan_file_parts), so memory is bounded at any world size (issue 55).
The files are the same whatever the parts."""

import pytest
import torch

from zeroshard.format import open_checkpoint
from zeroshard.toolkit import packed, plans
from zeroshard.toolkit import plan as plan_module
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.plan import rank_file_tasks
from zeroshard.toolkit.plans import RankFilePlans, carried_tensors
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.verify import verify

from checkpoints import read_checkpoint, training_state, write_checkpoint

TIER = "default"  # docs/TESTING.md


def planned_ranks(monkeypatch) -> list[int]:
    """Records how many output ranks each piece-planning call covered."""
    seen: list[int] = []
    original = plan_module.plan_ranks

    def spy(manifest, outputs, ranks):
        seen.append(len(list(ranks)))
        return original(manifest, outputs, ranks)

    monkeypatch.setattr(plan_module, "plan_ranks", spy)
    monkeypatch.setattr(packed, "plan_ranks", spy)
    return seen


@pytest.mark.parametrize("budget", [40, 10**9])
def test_a_reshard_plans_a_task_at_a_time_and_writes_the_same_files(tmp_path, monkeypatch, budget):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "w5"), specs, data, 5, rng=False)
    monkeypatch.setattr(plans, "PIECE_BUDGET", budget)
    monkeypatch.setattr(plan_module, "PIECE_BUDGET", budget)
    seen = planned_ranks(monkeypatch)
    reshard(str(tmp_path / "w5"), 7, str(tmp_path / "w7"))
    assert sum(seen) == 7  # every output planned once
    if budget < 10**9:
        assert len(seen) > 1 and max(seen) < 7  # never all of them at once
    assert verify(str(tmp_path / "w7")).ok
    torch.testing.assert_close(read_checkpoint(str(tmp_path / "w7")), read_checkpoint(str(tmp_path / "w5")),
                               rtol=0, atol=0)
    write_checkpoint(str(tmp_path / "n7"), specs, data, 7, rng=False)  # a native save at 7: same sizes
    native, resharded = open_checkpoint(str(tmp_path / "n7"))[1], open_checkpoint(str(tmp_path / "w7"))[1]
    assert [(f.name, f.size) for f in native.files] == [(f.name, f.size) for f in resharded.files]


def test_tasks_cover_every_rank_once_in_order_within_the_budget(tmp_path, monkeypatch):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "w48"), specs, data, 48, rng=False)
    manifest = open_checkpoint(str(tmp_path / "w48"))[1]
    outputs = RankFilePlans(carried_tensors(manifest, 64), 64, "0" * 32)
    monkeypatch.setattr(plan_module, "PIECE_BUDGET", 200)
    tasks = rank_file_tasks(outputs, input_world=48)
    assert [r for t in tasks for r in t.outputs] == list(range(64)) and all(t.plan is None for t in tasks)
    for task in tasks:  # the expected pieces of a task of several ranks stay under the budget
        pieces = sum(len(outputs.layouts.rank_layout(r).tensors) * (48 // 64 + 2) for r in task.outputs)
        assert len(task.outputs) == 1 or pieces <= 200, (task.outputs, pieces)
    assert len(tasks) > 1
    assert len(rank_file_tasks(outputs, input_world=48, workers=2)) >= 8  # a few tasks per worker


@pytest.mark.parametrize("max_shard_size,dtype", [(None, None), ("40KB", None), (None, "bf16")])
def test_a_consolidate_planned_in_parts_writes_the_same_bytes(tmp_path, monkeypatch, max_shard_size, dtype):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "w5"), specs, data, 5, rng=False)
    out = "one.safetensors" if max_shard_size is None else "hf"
    consolidate(str(tmp_path / "w5"), str(tmp_path / "whole" / out), max_shard_size=max_shard_size, dtype=dtype)
    parts = []
    original = plan_module._plan

    def counted(*args):
        parts.append(original(*args))
        return parts[-1]

    monkeypatch.setattr(plan_module, "_plan", counted)
    monkeypatch.setattr(plan_module, "PIECE_BUDGET", 12)  # a band of one input rank a part
    consolidate(str(tmp_path / "w5"), str(tmp_path / "parts" / out), max_shard_size=max_shard_size, dtype=dtype)
    assert len(parts) > 2  # each part reads its own band of input files, none read twice
    read = [set(p.input.tolist()) for p in parts]
    assert sum(len(r) for r in read) == len(set().union(*read)) == 5
    whole = sorted(p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*") if p.is_file())
    split = sorted(p.relative_to(tmp_path / "parts") for p in (tmp_path / "parts").rglob("*") if p.is_file())
    assert whole == split and len(whole) >= 1
    for name in whole:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "parts" / name).read_bytes(), name
