"""The engine's stages are strategies chosen once (issue 21): engine.py holds no stage branches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zeroshard.engine import grad_strategy as gs
from zeroshard.engine import param_strategy as ps

TIER = "default"  # docs/TESTING.md

ENGINE = Path(__file__).resolve().parents[1] / "zeroshard" / "engine" / "engine.py"


def test_engine_py_has_no_stage_branches() -> None:
    branch = re.compile(r"stage ==|stage >=|stage <|stage in |_stage3 is|_refresh is"
                        r"|\.stage\b.*\bif\b|\bif\b.*\.stage\b")
    lines = [(i, line) for i, line in enumerate(ENGINE.read_text().splitlines(), 1) if branch.search(line)]
    assert lines == []


def test_the_stage_is_read_only_where_strategies_are_chosen() -> None:
    uses = [line.strip() for line in ENGINE.read_text().splitlines() if "self.stage" in line]
    allowed = ("self.stage = ", "grad_cls: ", "param_cls: ", "return (f\"ZeroEngine(stage=")
    assert len(uses) == 4 and all(u.startswith(allowed) for u in uses), uses


@pytest.mark.parametrize("stage, hpz, world, grads, params", [
    (0, 1, 4, gs.AllReduceGrads, ps.Replicated),
    (1, 1, 4, gs.ScatterAtBoundary, ps.Regathered),
    (2, 1, 4, gs.ScatterEachBackward, ps.Regathered),
    (3, 1, 4, gs.ScatterEachBackward, ps.Partitioned),
    (3, 2, 4, gs.ScatterEachBackward, ps.Hierarchical),
    (3, 4, 4, gs.ScatterEachBackward, ps.Partitioned),  # one "node": plain stage 3
])
def test_strategy_choice(stage: int, hpz: int, world: int, grads: type, params: type) -> None:
    assert gs.grad_sharding_for(stage) is grads
    assert ps.param_residency_for(stage, hpz, world) is params
    assert params.partitioned == (stage == 3)
    assert grads.partitioned == (stage > 0) and grads.every_backward == (stage >= 2)
