"""Stage 3 really gathers and frees: which full parameters exist at points of forward/backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard

from distributed import run_ranks
from test_engine_models import batches, lm_loss, make_model, micro_batch

TIER = "default"  # docs/TESTING.md


def _materialized(model: torch.nn.Module) -> dict[str, bool]:
    return {n: p.untyped_storage().size() > 0 for n, p in model.named_parameters()}


def probe(rank: int, world: int, unit_classes: list[str]) -> dict[str, Any]:
    model = make_model(layers=4)
    engine = zeroshard.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        config={"zero_optimization": {"stage": 3, "stage3_unit_classes": unit_classes,
                                      "reduce_bucket_size": 8000}})
    seen: dict[str, Any] = {}
    # User hooks run after the engine's (registered at initialize): they see what the unit sees.
    model.blocks[1].fc1.register_forward_pre_hook(lambda m, a: seen.__setitem__("fwd", _materialized(model)))

    def after_fc1(module: Any, args: Any, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda g: seen.__setitem__("bwd", _materialized(model)))
    model.blocks[0].fc1.register_forward_hook(after_fc1)

    total_bytes = sum(p.numel() * 4 for p in model.parameters())
    for i, batch in enumerate(batches(3, 8)):
        x, y = micro_batch(batch, rank, world, 0, 1)
        loss = lm_loss(engine(x), y)
        seen[f"after_forward_{i}"] = engine.memory_report()["params"]
        engine.backward(loss)
        seen[f"after_backward_{i}"] = engine.memory_report()
        engine.step()
        if i == 0:  # the first backward uses the initial bucket order; later ones rank 0's observed order
            engine.reducer.peak_held = 0
    with torch.no_grad():
        out = engine.eval()(micro_batch(batches(1, 8)[0], rank, world, 0, 1)[0])
    seen["eval_finite"] = bool(out.isfinite().all())
    seen["after_eval"] = engine.memory_report()["params"]
    seen["stats"] = dict(engine.stage3_scheduler.stats)
    seen["traces"] = {k: len(v) for k, v in engine.stage3_scheduler.traces.items()}
    seen["reducer_peak"] = engine.reducer.peak_held
    seen["buckets"] = len(engine.reducer.buckets)
    seen["largest_bucket"] = max(b.total * (world + 1) * 4 for b in engine.reducer.buckets)  # fp32 in + out
    seen["largest_held"] = max(b.total * world * 4 for b in engine.reducer.buckets)  # its gradients, held
    seen["units"] = [u.name for u in engine.stage3_scheduler.units]
    seen["total_bytes"] = total_bytes
    return seen


@pytest.mark.parametrize("unit_classes", [[], ["Block"]], ids=["per-module", "per-block"])
def test_stage3_gathers_only_the_running_units(unit_classes: list[str]) -> None:
    world = 2
    for seen in run_ranks(probe, world, timeout=120, unit_classes=unit_classes):
        fwd, bwd = seen["fwd"], seen["bwd"]
        # Forward inside blocks.1.fc1: that unit (and its enclosing block's own unit) is there,
        # block 0 is gone.
        assert fwd["blocks.1.fc1.weight"] and fwd["blocks.1.gain"]
        assert not any(v for n, v in fwd.items() if n.startswith("blocks.0."))
        # Backward at blocks.0.fc1's output: block 1 (done) is gone, blocks.0.fc1 is back.
        assert bwd["blocks.0.fc1.weight"]
        assert not any(v for n, v in bwd.items() if n.startswith("blocks.1."))
        if not unit_classes:
            assert not bwd["blocks.0.qkv.weight"]  # not yet needed (prefetch may hold at most the next)
        for i in range(3):
            assert seen[f"after_forward_{i}"] == 0
            assert seen[f"after_backward_{i}"]["params"] == 0 and seen[f"after_backward_{i}"]["comm"] == 0
        assert seen["eval_finite"] and seen["after_eval"] == 0
        stats = seen["stats"]
        # Iterations 2 and 3 follow the recorded orders: (nearly) every unit after the first of
        # each pass was prefetched (a few are skipped because they are still held).
        possible = 2 * (seen["traces"]["forward"] - 1 + seen["traces"]["backward"] - 1)
        assert stats["prefetch_hits"] >= 0.8 * possible, (stats, seen["traces"])
        assert stats["gathered_bytes"] == 0
        # Gradient buckets are finished as backward goes: never a whole fp32 gradient at once.
        # (two in flight and one filling, whose gradients are held until its one copy-in), after
        # the first backward fixed the bucket order.
        assert seen["buckets"] > 5
        assert seen["reducer_peak"] <= 3 * seen["largest_bucket"] + seen["largest_held"]
        assert seen["reducer_peak"] < seen["total_bytes"] * world / 2
        assert stats["peak_gathered_bytes"] < seen["total_bytes"] / 2
        if unit_classes:
            assert "blocks.0" in seen["units"] and "blocks.0.fc1" not in seen["units"]
        else:
            assert "blocks.0" in seen["units"] and "blocks.0.fc1" in seen["units"]


def released_state_dict(rank: int, world: int) -> dict[str, Any]:
    model = make_model()
    engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": 3}})
    x, y = micro_batch(batches(1, 8)[0], rank, world, 0, 1)
    engine.backward(lm_loss(engine(x), y))
    engine.step()
    out: dict[str, Any] = {}
    try:  # `torch.save(engine.module.state_dict())`: full shapes, no data, a file that cannot be loaded
        model.state_dict()
        out["refused"] = None
    except zeroshard.ZeroshardError as exc:
        out["refused"] = str(exc)
    out["full"] = sorted(engine.full_state_dict())  # the way to the weights
    out["own_reads"] = len(model.state_dict(keep_vars=True))  # the engine's own reads are untouched
    return out


def test_a_stage_3_module_state_dict_of_partitioned_parameters_is_refused() -> None:
    first, second = run_ranks(released_state_dict, 2)
    for r in (first, second):
        assert r["refused"] and "is partitioned" in r["refused"] and "engine.full_state_dict()" in r["refused"], r
        assert r["own_reads"] > 0
    assert first["full"] and second["full"] == []
