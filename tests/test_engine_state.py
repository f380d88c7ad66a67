"""The state interface the checkpoint code builds on: checkpoint_state / restore (the EngineState
contract), named_shards / load_shards, full state dicts.

- named_shards follows zeroshard.partition exactly (ranges, chunk sizes, zero padding) and
  carries the optimizer state in the same layout;
- full_state_dict -> load_full_state_dict into a differently initialised engine round-trips;
- shards saved at one world size/stage, reassembled by range arithmetic and loaded at another,
  continue training exactly like the original run (a reshard, done by hand here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard
from zeroshard.partition import chunk_size, shard_range

from distributed import run_ranks
from test_engine_models import assert_state_close, batches, lm_loss, make_model, micro_batch

TIER = "mixed"  # docs/TESTING.md


def _engine(stage: int, seed: int = 0) -> Any:
    model = make_model(seed=seed)
    return zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                config={"zero_optimization": {"stage": stage}, "gradient_clipping": 1.0})


def _train(engine: Any, rank: int, world: int, steps: range) -> None:
    data = batches(max(steps) + 1, 8)
    for i in steps:
        x, y = micro_batch(data[i], rank, world, 0, 1)
        engine.backward(lm_loss(engine(x), y))
        engine.step()


def _snapshot(engine: Any) -> dict[str, Any]:
    shards = {}
    for name, info in engine.named_shards():
        shards[name] = {"range": (info.start, info.end), "shape": info.shape, "world": info.world_size,
                        "fragment": info.fragment.clone(),
                        "tensor_state": {k: v[: info.end - info.start].clone() for k, v in info.tensor_state.items()},
                        "scalar_state": {k: v.clone() if torch.is_tensor(v) else v
                                         for k, v in info.scalar_state.items()}}
    state = engine.checkpoint_state()
    return {"shards": shards, "engine": {"counters": state.counters, "loss_scaler": dict(state.loss_scaler),
                                         "param_groups": state.param_groups}}


def roundtrip(rank: int, world: int, stage: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    a = _engine(stage)
    _train(a, rank, world, range(2))
    full = [a.full_state_dict()]
    dist.broadcast_object_list(full, src=0)
    full = full[0]

    # named_shards: exactly the partition rule, padding zero, optimizer state in the same layout.
    problems = []
    for name, info in a.named_shards():
        numel = torch.Size(info.shape).numel()
        if (info.start, info.end) != shard_range(numel, info.world_size, a.shard_rank):
            problems.append(f"{name}: range")
        if info.chunk != chunk_size(numel, info.world_size) or info.master.numel() != info.chunk:
            problems.append(f"{name}: chunk")
        if not torch.equal(info.fragment, full[name].reshape(-1)[info.start: info.end]):
            problems.append(f"{name}: fragment")
        if info.master[info.end - info.start:].any():
            problems.append(f"{name}: padding")
        if info.requires_grad:
            if set(info.tensor_state) != {"exp_avg", "exp_avg_sq"} or set(info.scalar_state) != {"step"}:
                problems.append(f"{name}: state keys {list(info.optimizer_state)}")
            if any(v.shape != info.master.shape for v in info.tensor_state.values()):
                problems.append(f"{name}: state shape")
        elif info.optimizer_state:
            problems.append(f"{name}: frozen param has optimizer state")
    out["problems"] = problems
    out["names"] = [n for n, _ in a.named_shards()]

    # full state dict into a differently initialised engine.
    b = _engine(stage, seed=7)
    b.load_full_state_dict(full)
    out["b_full"] = b.full_state_dict()
    out["a_full"] = full

    # a's whole EngineState restored into a third engine: it continues exactly like the first
    # (and shares nothing with it: restore copies unless told to adopt).
    c = _engine(stage, seed=9)
    c.restore(a.checkpoint_state())
    out["snapshot"] = _snapshot(a)  # after 2 steps, for the reshard test
    _train(a, rank, world, range(2, 3))
    _train(c, rank, world, range(2, 3))
    out["a_next"], out["c_next"] = a.full_state_dict(), c.full_state_dict()
    out["c_steps"] = c.global_steps
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shards_and_state_dicts_round_trip(stage: int) -> None:
    results = run_ranks(roundtrip, 2, timeout=120, stage=stage)
    for r in results:
        assert r["problems"] == []
    r0 = results[0]
    assert r0["names"] == [n for n, _ in make_model().named_parameters()]  # tied: first name only
    assert set(r0["a_full"]) == set(make_model().state_dict())  # both tied names present
    for k, v in r0["a_full"].items():
        assert v.dtype == torch.float32 and torch.equal(v, r0["b_full"][k]), k
    for k, v in r0["a_next"].items():
        assert torch.equal(v, r0["c_next"][k]), k
    assert r0["c_steps"] == 3


def _assemble(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Full tensors (weights and per-element optimizer state) from every rank's shards."""
    full: dict[str, Any] = {}
    for name, first in snapshots[0]["shards"].items():
        numel = torch.Size(first["shape"]).numel()
        parts = sorted((s["shards"][name] for s in snapshots), key=lambda s: s["range"])
        if first["world"] == 1:
            parts = parts[:1]  # stage 0: every rank holds everything
        def cat(key, sub=None):
            return torch.cat([p[key] if sub is None else p[key][sub] for p in parts])[:numel]
        full[name] = {"fragment": cat("fragment"),
                      "tensor_state": {k: cat("tensor_state", k) for k in first["tensor_state"]},
                      "scalar_state": first["scalar_state"]}
    return full


def resume(rank: int, world: int, stage: int, full: dict[str, Any], engine_state: dict[str, Any]) -> dict[str, Any]:
    """Load the reassembled state at this world size/stage (each rank slices its range), train."""
    engine = _engine(stage, seed=3)
    states = {}
    for name, info in engine.named_shards():
        s, e = info.start, info.end
        states[name] = {"fragment": full[name]["fragment"][s:e],
                        "optimizer_state": {**{k: v[s:e] for k, v in full[name]["tensor_state"].items()},
                                            **full[name]["scalar_state"]}}
    engine.load_shards(states)
    target = engine.checkpoint_state()
    engine.restore(dataclasses.replace(target, params=(), buffers=(), **engine_state), strict=False)
    _train(engine, rank, world, range(2, 3))
    return {"full": engine.full_state_dict()}


@pytest.mark.slow
def test_shards_saved_on_2_ranks_resume_on_4_ranks_at_another_stage() -> None:
    saved = run_ranks(roundtrip, 2, timeout=120, stage=1)
    full = _assemble([r["snapshot"] for r in saved])
    engine_state = saved[0]["snapshot"]["engine"]
    for stage in (3, 0):
        resumed = run_ranks(resume, 4, timeout=120, stage=stage, full=full, engine_state=engine_state)[0]
        # Same math, different rank count: equal up to float summation order.
        assert_state_close(resumed["full"], saved[0]["a_next"], 1e-5)
