"""memory_report() agrees with the ZeRO formulas, bytes per rank, for every stage.

bf16 compute, Adam, N ranks, Ψ = unique parameter elements, C = Σ chunk_size(numel, N) (this
rank's padded shard elements, ≈ Ψ/N). "optimizer" is the paper's KΨ: fp32 master (4) + Adam
moments (8), K = 12. Measured in the second optimizer step (Adam state exists):

A) after the first micro-step's backward (gradient accumulation 2, not a boundary):
     stage 0: params 2Ψ + grads 2Ψ (bf16 .grad) + optimizer 12Ψ          = 16Ψ      (paper: 16Ψ)
     stage 1: params 2Ψ + grads 2Ψ + optimizer 12C                       = 4Ψ + 12C (paper: 4Ψ + 12Ψ/N)
     stage 2: params 2Ψ + grads 4C (fp32 shard) + optimizer 12C          = 2Ψ + 16C (paper: 2Ψ + 14Ψ/N)
     stage 3: grads 4C + optimizer 12C (no bf16 param shard is kept)     = 16C      (paper: 16Ψ/N)
   The departures from the paper: stages 2-3 accumulate the reduced gradient shard in fp32
   (4C, not 2Ψ/N), and stage 3 keeps no 16-bit parameter shard (the fp32 master is cast when
   gathered), so the stage-3 total is the paper's.
B) after the boundary backward (before step): every stage has reduced its gradients into fp32
   and freed `.grad`: stage 0 grads 4Ψ; stages 1-3 grads 4C; params/optimizer as above.

Checked within 2% (Adam's per-parameter 0-dim `step` tensors are the only extra bytes).
In fp32 at stage 0 the master is the parameter itself: 4Ψ + 4Ψ + 8Ψ = 16Ψ (the DDP figure).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard
from zeroshard.partition import chunk_size

from distributed import run_ranks
from test_engine_models import batches, lm_loss, make_model, micro_batch

TIER = "mixed"  # docs/TESTING.md


def measure(rank: int, world: int, stage: int, dtype: str) -> dict[str, Any]:
    model = make_model(frozen=False)  # every parameter trained: the formulas have no frozen term
    psi = sum(p.numel() for p in model.parameters())
    c = sum(chunk_size(p.numel(), world) for p in model.parameters())
    cfg: dict[str, Any] = {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 2}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                                  config=cfg)
    out: dict[str, Any] = {"psi": psi, "c": c}
    for i, batch in enumerate(batches(2, 8)):
        for m in range(2):
            x, y = micro_batch(batch, rank, world, m, 2)
            engine.backward(lm_loss(engine(x), y))
            if i == 1:
                out["A" if m == 0 else "B"] = engine.memory_report()
            engine.step()
    out["after_step"] = engine.memory_report()
    return out


def expected(stage: int, point: str, psi: int, c: int) -> dict[str, int]:
    if stage == 0:
        return {"params": 2 * psi, "grads": 2 * psi if point == "A" else 4 * psi, "optimizer": 12 * psi}
    return {"params": 2 * psi if stage < 3 else 0,
            "grads": 2 * psi if (stage == 1 and point == "A") else 4 * c,
            "optimizer": 12 * c}


def close(got: int, want: int) -> bool:
    return abs(got - want) <= 0.02 * want + 256  # 2%, plus Adam's 4-byte step tensors


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_memory_report_matches_formulas_bf16(world: int) -> None:
    for stage in (0, 1, 2, 3):
        for rank, r in enumerate(run_ranks(measure, world, timeout=120, stage=stage, dtype="bf16")):
            for point in ("A", "B"):
                want = expected(stage, point, r["psi"], r["c"])
                got = r[point]
                for key, value in want.items():
                    assert close(got[key], value), (stage, rank, point, key, got[key], value)
                assert close(got["total"], sum(want.values())), (stage, rank, point, got)
                assert got["master"] == 4 * (r["psi"] if stage == 0 else r["c"])
                assert got["comm"] == 0 and got["buffers"] == 0
            # After a step at stages 1-2 the updated parameters' all-gather is in flight (one
            # bucket here): world x chunk elements of bf16 are held until the next forward.
            in_flight = world * r["c"] * 2 if stage in (1, 2) else 0
            assert r["after_step"]["comm"] == in_flight, (stage, rank, r["after_step"]["comm"], in_flight)


def test_memory_report_fp32_stage0_is_ddp() -> None:
    r = run_ranks(measure, 2, timeout=120, stage=0, dtype="fp32")[0]
    psi = r["psi"]
    assert r["A"]["master"] == 0  # aliases the parameters
    assert close(r["A"]["total"], 16 * psi), r["A"]
