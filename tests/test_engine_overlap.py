"""Stages 1-2: after step() the parameter all-gathers are still in flight; each module waits for
its own bucket in the next forward, and the result equals training without overlap."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard

from distributed import run_ranks
from test_engine_models import batches, lm_loss, make_model, micro_batch

TIER = "default"  # docs/TESTING.md


def overlap(rank: int, world: int, stage: int) -> dict[str, Any]:
    model = make_model()
    engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": stage, "allgather_bucket_size": 3000}})
    x, y = micro_batch(batches(1, 8)[0], rank, world, 0, 1)
    engine.backward(lm_loss(engine(x), y))
    engine.step()  # the first step: buckets now follow the first forward's order
    engine.backward(lm_loss(engine(x), y))
    before = model.blocks[0].fc2.weight.detach().clone()
    engine.step()
    out: dict[str, Any] = {"buckets": len(engine.param_refresh.buckets),
                           "pending_after_step": engine.param_refresh.pending,
                           "done_after_step": engine.param_refresh.done}
    seen = {}
    # Runs after the engine's pre-hook (registered at initialize): sees what fc2's forward sees.
    model.blocks[0].fc2.register_forward_pre_hook(
        lambda m, a: seen.update(stale=torch.equal(m.weight, before), done=engine.param_refresh.done))
    engine(x)
    out["fc2_saw_old_weights"] = seen["stale"]
    out["done_at_fc2"] = seen["done"]
    out["pending_after_forward"] = engine.param_refresh.pending
    full = engine.full_state_dict()
    out["params_equal_masters"] = (rank != 0) or all(
        torch.equal(p.detach(), full[n]) for n, p in model.named_parameters() if n in full)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_parameter_gathers_overlap_the_next_forward(stage: int) -> None:
    for r in run_ranks(overlap, 2, stage=stage):
        assert r["buckets"] > 3 and r["pending_after_step"] and r["done_after_step"] == 0
        assert not r["fc2_saw_old_weights"]  # the module waited for its own bucket
        assert 0 < r["done_at_fc2"] < r["buckets"]  # ... and not for the later ones
        assert not r["pending_after_forward"] and r["params_equal_masters"]


def stale_state_dict(rank: int, world: int) -> dict[str, Any]:
    model = make_model()
    engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": 2, "allgather_bucket_size": 3000}})
    x, y = micro_batch(batches(1, 8)[0], rank, world, 0, 1)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    out: dict[str, Any] = {}
    try:  # what `torch.save(engine.module.state_dict())` on rank 0 would read: the weights before the step
        model.state_dict()
        out["refused"] = None
    except zeroshard.ZeroshardError as exc:
        out["refused"] = str(exc)
    full = engine.full_state_dict()  # collective: completes the gathers itself
    state = model.state_dict()
    out["equal_after"] = rank != 0 or all(torch.equal(state[n], full[n]) for n in full)
    return out


def test_a_module_state_dict_with_gathers_in_flight_is_refused_not_stale() -> None:
    for r in run_ranks(stale_state_dict, 2):
        assert r["refused"] and "engine.wait_params() on every rank" in r["refused"], r
        assert r["equal_after"]
