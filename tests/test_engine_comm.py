"""comm_report() against the ZeRO paper's communication volume (issue 21).

Per rank per optimizer step, with Ψ parameter elements over N ranks, by the ring formulas in
zeroshard/engine/comm_ledger.py:
    stage 0 (DDP):  all-reduce of the gradients                          2Ψ(N-1)/N
    stages 1, 2:    reduce-scatter of the gradients + all-gather of the
                    updated parameters                                  2Ψ(N-1)/N
    stage 3:        all-gather for forward and again for backward +
                    reduce-scatter of the gradients                     3Ψ(N-1)/N
Stages 1-3 move padded shards: Ψ' = N·Σ chunk_size(numel, N), at most N-1 elements more per
parameter. Measured over steps 2-4 (the first backward also broadcasts the bucket order once).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard
from zeroshard.partition import chunk_size

from distributed import run_ranks
from test_engine_models import DIM, VOCAB, batches, lm_loss, make_model, micro_batch

TIER = "mixed"  # docs/TESTING.md


def measure(rank: int, world: int, stages: list[int], dtype: str, awkward: bool) -> list[dict[str, Any]]:
    out = []
    for stage in stages:
        model = make_model(frozen=False, tied=awkward, twice=awkward)
        cfg: dict[str, Any] = {"zero_optimization": {"stage": stage}}
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                                      config=cfg)
        for i, batch in enumerate(batches(4, 8)):
            x, y = micro_batch(batch, rank, world, 0, 1)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            if i == 0:
                engine.reset_comm_report()
        psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        padded = world * sum(chunk_size(p.numel(), world) for p in {id(p): p for p in model.parameters()}.values())
        out.append({"stage": stage, "psi": psi, "padded": padded, "report": engine.comm_report(),
                    "reduce_bytes": torch.empty((), dtype=engine.config.reduce_dtype).element_size()})
    return out


def payload(report: dict, kind: str) -> float:
    return report.get(kind, {}).get("payload_elements", 0.0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_every_stage_moves_what_the_paper_says(world: int) -> None:
    results = run_ranks(measure, world, timeout=240, stages=[0, 1, 2, 3], dtype="fp32", awkward=False)
    for rank_results in results:  # every rank issues the same collectives
        for r in rank_results:
            stage, psi, padded, report = r["stage"], r["psi"], r["padded"], r["report"]
            ring = (world - 1) / world
            if stage == 0:
                assert payload(report, "all_reduce") == psi
                assert report["total"]["sent_elements"] == pytest.approx(2 * psi * ring)
            else:
                assert payload(report, "all_reduce") == 0  # no hidden all-reduce (no clipping here)
                assert payload(report, "reduce_scatter") == padded
                assert payload(report, "all_gather") == (2 if stage == 3 else 1) * padded
                factor = 3 if stage == 3 else 2
                assert report["total"]["sent_elements"] == pytest.approx(factor * padded * ring)
                assert psi <= padded <= psi + (world - 1) * 40  # fewer than 40 parameters here
            assert payload(report, "broadcast") == 0  # the bucket order went out in step 1 only
            assert report["total"]["sent_bytes"] == pytest.approx(4 * report["total"]["sent_elements"])


@pytest.mark.timeout(300)
def test_bf16_gathers_move_bf16_bytes_and_reductions_the_reduce_dtype() -> None:
    for r in run_ranks(measure, 2, timeout=240, stages=[1, 3], dtype="bf16", awkward=False)[0]:
        report = r["report"]
        assert report["all_gather"]["payload_bytes"] == 2 * report["all_gather"]["payload_elements"]
        assert report["reduce_scatter"]["payload_bytes"] == r["reduce_bytes"] * r["padded"]


@pytest.mark.timeout(300)
def test_stage3_extra_traffic_is_exactly_the_tied_weight_and_the_module_run_twice() -> None:
    """TinyGPT's awkward cases: the tied embedding belongs to two units (gathered by each, in
    forward and backward: two more gathers of it), and `mix` runs twice per forward (gathered for
    each call, freed after each; gathered once for a backward that accumulates both calls)."""
    r = run_ranks(measure, 2, timeout=240, stages=[3], dtype="fp32", awkward=True)[0][0]
    tied = 2 * chunk_size(VOCAB * DIM, 2)
    mix = 2 * (chunk_size(DIM * DIM, 2) + chunk_size(DIM, 2))
    assert payload(r["report"], "all_gather") == 2 * r["padded"] + 2 * tied + mix
    assert payload(r["report"], "reduce_scatter") == r["padded"]
