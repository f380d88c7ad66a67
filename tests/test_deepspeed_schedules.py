"""zeroshard.deepspeed.lr_schedules against DeepSpeed's formulas (written out here) and, when
DeepSpeed is installed, against deepspeed.runtime.lr_schedules itself, step by step."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from zeroshard.deepspeed import lr_schedules as ours

TIER = "mixed"  # docs/TESTING.md

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
STEPS = 25

CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 7}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": [1e-2, 2e-2], "warmup_num_steps": 1, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_max_lr": 3e-3, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 15, "warmup_num_steps": 3, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5, "cycle_second_step_size": 7,
                  "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 6,
                  "cycle_first_stair_count": 3}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 4, "lr_range_test_staircase": True}),
]


def _optimizer() -> torch.optim.Optimizer:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5e-3}], lr=1e-3)


def _sequence(module, name: str, params: dict) -> list[tuple]:
    opt = _optimizer()
    sched = getattr(module, name)(opt, **params)
    seq = [tuple((g["lr"], tuple(g["betas"])) for g in opt.param_groups)]
    for _ in range(STEPS):
        sched.step()
        seq.append(tuple((g["lr"], tuple(g["betas"])) for g in opt.param_groups))
    return seq


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("name,params", CASES)
def test_same_sequence_as_deepspeed(name, params):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import lr_schedules as theirs

    assert _sequence(ours, name, params) == _sequence(theirs, name, params)


def _lrs(name: str, params: dict, group: int = 0) -> list[float]:
    return [step[group][0] for step in _sequence(ours, name, params)]


def test_warmup_lr_formula():
    """lr(j scheduler steps) = min + (max-min) * log(j)/log(N) while j-1 < N; construction and
    the first step both give min (the step-off that bit hand-made versions)."""
    lrs = _lrs("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 7})
    expect = [1e-4] + [1e-4 + (1e-2 - 1e-4) * (math.log(j) / math.log(7) if j - 1 < 7 else 1.0)
                       for j in range(1, STEPS + 1)]
    assert lrs == pytest.approx(expect, rel=1e-12)
    assert lrs[0] == lrs[1] == 1e-4 and lrs[-1] == 1e-2


def test_warmup_decay_formula():
    lrs = _lrs("WarmupDecayLR", {"total_num_steps": 12, "warmup_max_lr": 3e-3, "warmup_num_steps": 4,
                                 "warmup_type": "linear"})
    expect = [0.0] + [3e-3 * ((j - 1) / 4 if j - 1 < 4 else max(0.0, (12 - (j - 1)) / 8)) for j in range(1, STEPS + 1)]
    assert lrs == pytest.approx(expect, rel=1e-12, abs=1e-18)


def test_warmup_cosine_formula_scales_each_group():
    params = {"total_num_steps": 15, "warmup_num_steps": 3, "warmup_type": "linear", "cos_min_ratio": 0.0}

    def ratio(j: int) -> float:
        it = j - 1
        if it < 3:
            return it / 3
        return (1 + math.cos(math.pi * min(1.0, (it - 3 + 1) / 12))) / 2

    for group, base in ((0, 1e-3), (1, 5e-3)):
        expect = [0.0] + [base * ratio(j) for j in range(1, STEPS + 1)]
        assert _lrs("WarmupCosineLR", params, group) == pytest.approx(expect, rel=1e-12, abs=1e-18)


def test_one_cycle_triangle_and_momentum():
    seq = _sequence(ours, "OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4})
    lrs = [s[0][0] for s in seq]
    betas = [s[0][1] for s in seq]
    assert lrs[0] == 1e-4 and betas[0] == (0.8, 0.99)
    # after j steps, iteration j-1; scale = x / 0.5 on the way up, with x = (j)/(8) within the first cycle
    assert lrs[3] == pytest.approx(1e-4 + (1e-2 - 1e-4) * (3 / 8) / 0.5)
    assert max(lrs[:9]) == pytest.approx(1e-2) and lrs[4] == pytest.approx(1e-2)
    assert betas[4][0] == pytest.approx(0.8) and betas[8][0] == pytest.approx(0.9)  # beta1 moves against the LR


def test_state_round_trip_resumes_the_sequence():
    opt = _optimizer()
    first = ours.WarmupDecayLR(opt, total_num_steps=20, warmup_num_steps=5)
    for _ in range(7):
        first.step()
    state = first.state_dict()
    assert state == {"last_batch_iteration": 6}
    first.step()
    opt2 = _optimizer()
    second = ours.WarmupDecayLR(opt2, total_num_steps=20, warmup_num_steps=5)
    second.load_state_dict(state)
    second.step()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]


def test_build_scheduler_refuses_unknown_types():
    with pytest.raises(ValueError, match="not supported"):
        ours.build_scheduler({"type": "Cosine"}, _optimizer())
