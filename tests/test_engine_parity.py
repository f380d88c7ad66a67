"""Distributed training through the engine matches single-process training on the global batch.

Each rank trains on its slice of every global batch (world x gradient-accumulation parts); the
engine averages gradients over ranks and micro-steps, so parameters and the batch-mean loss must
equal plain single-process training on the whole batch: within 1e-5 relative in fp32 (per
tensor, ||a - b|| / ||b||; the observed error is ~3e-7, float summation order).
The model (test_engine_models.TinyGPT) has tied embeddings, a frozen parameter, a module called
twice per forward and a 3-element parameter (so at world 4 one rank owns none of it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard

from distributed import run_ranks
from test_engine_models import (
    assert_losses_close,
    assert_state_close,
    batches,
    build_optimizer,
    lm_loss,
    make_model,
    micro_batch,
    reference_run,
    train_step,
)

TIER = "mixed"  # docs/TESTING.md

STEPS, GLOBAL_BATCH = 3, 16
FP32_TOL = 1e-5


def train(rank: int, world: int, *, stage: int, gas: int = 2, optimizer: str = "adam", clip: float = 0.5,
          dtype: str = "fp32", scheduler: bool = False, zero: dict | None = None,
          fp16: dict | None = None, steps: int = STEPS, model_kwargs: dict | None = None,
          skip_mix: tuple[int, ...] = ()) -> dict[str, Any]:
    """Train through the engine; return per-step global losses and (rank 0) the full weights."""
    model = make_model(**(model_kwargs or {}))
    opt = build_optimizer(optimizer, model)
    cfg: dict[str, Any] = {
        # Small buckets: several buckets per backward, exercising launch order and rebuild.
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000, "allgather_bucket_size": 4000,
                              **(zero or {})},
        "gradient_accumulation_steps": gas, "gradient_clipping": clip,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, **(fp16 or {})}
    engine = zeroshard.initialize(model=model, optimizer=opt, config=cfg)
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5) if scheduler else None
    losses = []
    for step, batch in enumerate(batches(steps, GLOBAL_BATCH)):
        model.use_mix = step not in skip_mix
        losses.append(train_step(engine, batch, rank, world, gas))
        if sched:
            sched.step()
    return {"losses": losses, "state": engine.full_state_dict(), "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps, "skipped": engine.skipped_steps, "scale": engine.loss_scale,
            "lrs": [g["lr"] for g in engine.optimizer.param_groups]}


def train_many(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several engines one after another in one launch (saves process start-up time)."""
    return [train(rank, world, **run) for run in runs]


def check(result: dict[str, Any], ref: dict[str, Any], tol: float = FP32_TOL) -> None:
    assert_losses_close(result["losses"], ref["losses"], tol)
    assert_state_close(result["state"], ref["state"], tol)


@pytest.fixture(scope="module")
def adam_reference() -> dict[str, Any]:
    return reference_run(STEPS, GLOBAL_BATCH, "adam", clip=0.5)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_single_process_adam(stage: int, adam_reference: dict[str, Any]) -> None:
    """Adam, 2 ranks, accumulation 2, clipping (active: norms are > 0.5), tied/frozen/twice."""
    results = run_ranks(train, 2, timeout=120, stage=stage)
    check(results[0], adam_reference)
    assert results[0]["global_steps"] == STEPS and results[0]["micro_steps"] == 2 * STEPS
    assert results[1]["state"] == {}  # full weights go to rank 0 only
    assert results[0]["losses"] == results[1]["losses"]


@pytest.mark.slow
def test_all_stages_match_with_sgd_momentum_on_4_ranks() -> None:
    """SGD with momentum and weight decay; 4 ranks, so `temp` (3 elements) leaves rank 3 empty."""
    ref = reference_run(STEPS, GLOBAL_BATCH, "sgd", clip=0.5)
    runs = [{"stage": s, "optimizer": "sgd", "gas": 1 if s % 2 else 2} for s in (0, 1, 2, 3)]
    for run, result in zip(runs, run_ranks(train_many, 4, timeout=180, runs=runs)[0]):
        check(result, ref)


def test_param_groups_lr_scheduler_and_no_clipping() -> None:
    """Two AdamW groups (own lr/decay) and a StepLR attached to engine.optimizer."""
    ref = reference_run(STEPS, GLOBAL_BATCH, "grouped_adamw", clip=0.0, scheduler=True)
    runs = [{"stage": s, "optimizer": "grouped_adamw", "clip": 0.0, "scheduler": True} for s in (1, 3)]
    for result in run_ranks(train_many, 2, timeout=120, runs=runs)[0]:
        check(result, ref)
        assert result["lrs"] == [1e-2 * 0.5 ** STEPS, 5e-3 * 0.5 ** STEPS]


def test_stage3_unit_variants_and_synchronous_comm(adam_reference: dict[str, Any]) -> None:
    """Block-level units, the root as a unit, no prefetch, no overlap: same numbers."""
    zeros = [{"stage3_unit_classes": ["Block"]},
             {"stage3_unit_classes": ["Block", "TinyGPT"], "stage3_prefetch": False},
             {"overlap_comm": False, "stage3_prefetch": False}]
    runs = [{"stage": 3, "zero": z} for z in zeros] + [{"stage": 2, "zero": {"overlap_comm": False}}]
    for result in run_ranks(train_many, 2, timeout=120, runs=runs)[0]:
        check(result, adam_reference)


def test_plain_model_without_awkward_cases(adam_reference: dict[str, Any]) -> None:
    """Untied, nothing frozen, no reuse: the ordinary case works too (stages 2 and 3)."""
    kw = {"tied": False, "frozen": False, "twice": False}
    ref = reference_run(STEPS, GLOBAL_BATCH, "adam", clip=0.5, model_kwargs=kw)
    runs = [{"stage": s, "model_kwargs": kw} for s in (2, 3)]
    for result in run_ranks(train_many, 2, timeout=120, runs=runs)[0]:
        check(result, ref)


def test_bf16_tracks_fp32_reference(adam_reference: dict[str, Any]) -> None:
    """bf16 compute, fp32 masters/optimizer: losses within 1%, weights within 5%."""
    runs = [{"stage": s, "dtype": "bf16"} for s in (0, 1, 2, 3)]
    for result in run_ranks(train_many, 2, timeout=120, runs=runs)[0]:
        assert_losses_close(result["losses"], adam_reference["losses"], 1e-2)
        assert_state_close(result["state"], adam_reference["state"], 5e-2)
        assert result["global_steps"] == STEPS


def test_fp16_tracks_fp32_reference(adam_reference: dict[str, Any]) -> None:
    """fp16 with a loss scale that does not overflow on this model: tracks fp32 like bf16."""
    runs = [{"stage": s, "dtype": "fp16", "fp16": {"initial_scale_power": 8}} for s in (1, 3)]
    for result in run_ranks(train_many, 2, timeout=120, runs=runs)[0]:
        assert result["skipped"] == 0 and result["scale"] == 2.0 ** 8
        assert_losses_close(result["losses"], adam_reference["losses"], 1e-2)
        assert_state_close(result["state"], adam_reference["state"], 5e-2)


def overflow_run(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Step 1 normal, step 2 with an inf loss on rank 1 only, step 3 normal."""
    model = make_model()
    cfg = {"zero_optimization": {"stage": stage},
           "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                                  config=cfg)
    seen = []
    for i, batch in enumerate(batches(3, 8)):
        x, y = micro_batch(batch, rank, world, 0, 1)
        loss = lm_loss(engine(x), y)
        if i == 1 and rank == 1:
            loss = loss * float("inf")  # the overflow happens on one rank only
        before = {n: s.fragment.clone() for n, s in engine.named_shards()}
        engine.backward(loss)
        engine.step()
        changed = any(not torch.equal(before[n], s.fragment) for n, s in engine.named_shards())
        seen.append((engine.global_steps, engine.skipped_steps, engine.loss_scale, changed))
    return {"seen": seen, "finite": all(bool(s.master.isfinite().all()) for _, s in engine.named_shards())}


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_skips_step_and_lowers_scale(stage: int) -> None:
    for result in run_ranks(overflow_run, 2, timeout=120, stage=stage):
        # (global_steps, skipped_steps, loss_scale, weights changed) after each step
        assert result["seen"] == [(1, 0, 256.0, True), (1, 1, 128.0, False), (2, 1, 128.0, True)]
        assert result["finite"]


def test_parameters_without_gradient_in_some_steps() -> None:
    """`mix` is skipped on step 1: its gradient is zero there (plain SGD: same as no update),
    and at stage 3 the unit order deviates from the recorded one (prefetch must cope)."""
    ref = reference_run(STEPS, GLOBAL_BATCH, "plain_sgd", skip_mix=(1,))
    runs = [{"stage": s, "optimizer": "plain_sgd", "clip": 0.0, "skip_mix": (1,)} for s in (0, 1, 2, 3)]
    for result in run_ranks(train_many, 2, timeout=120, runs=runs)[0]:
        check(result, ref)


def test_frozen_layer_in_the_middle() -> None:
    """A frozen Linear inside a block: its weight must still be gathered for backward (stage 3)
    though it never gets a gradient; nothing may update it."""
    kw = {"freeze": ("blocks.0.fc1.weight", "blocks.0.fc1.bias", "blocks.1.gain")}
    ref = reference_run(STEPS, GLOBAL_BATCH, "adam", clip=0.5, model_kwargs=kw)
    runs = [{"stage": s, "model_kwargs": kw} for s in (1, 3)]
    for result in run_ranks(train_many, 2, timeout=120, runs=runs)[0]:
        check(result, ref)
        assert torch.equal(result["state"]["blocks.0.fc1.weight"], make_model().blocks[0].fc1.weight)
