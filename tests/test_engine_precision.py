"""Loss scaling rules (DeepSpeed's DynamicLossScaler semantics) and input casting."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from zeroshard.engine.config import FP16Config
from zeroshard.engine.precision import LossScaler, cast_floating

TIER = "mixed"  # docs/TESTING.md


def test_disabled_scaler_is_inert() -> None:
    s = LossScaler(FP16Config(enabled=False))
    s.update(overflow=True)
    assert s.scale == 1.0 and not s.enabled


def test_overflow_lowers_scale_after_hysteresis() -> None:
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=4, hysteresis=2))
    s.update(overflow=True)
    assert s.scale == 16.0  # first overflow is absorbed by hysteresis
    s.update(overflow=True)
    assert s.scale == 8.0
    s.update(overflow=True)
    assert s.scale == 4.0


def test_scale_grows_after_a_clean_window_and_respects_the_minimum() -> None:
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=2, loss_scale_window=3, hysteresis=1,
                              min_loss_scale=2.0))
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 4.0  # DeepSpeed grows at the good step after a window of them, not at the window's last
    s.update(overflow=False)
    assert s.scale == 8.0
    for _ in range(5):
        s.update(overflow=True)
    assert s.scale == 2.0
    state = s.state_dict()
    other = LossScaler(FP16Config(enabled=True))
    other.load_state_dict(state)
    assert other.scale == 2.0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("consecutive", [False, True])
def test_dynamic_scaling_follows_deepspeeds_own_scaler_step_for_step(consecutive, monkeypatch) -> None:
    """The same overflow sequences through DeepSpeed's DynamicLossScaler and ours: the same scale
    and hysteresis after every step (runs of good steps long enough to grow, overflows alone and in
    a row, down to the minimum). Its overflow messages ask DeepSpeed's process group for the rank:
    answered by a stand-in, as there is none here; the arithmetic is DeepSpeed's own."""
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    monkeypatch.setattr(loss_scaler, "dist", type("OneRank", (), {"get_rank": staticmethod(lambda: 0)}))
    monkeypatch.setattr(loss_scaler, "log_dist", lambda *args, **kwargs: None)

    rng = random.Random(0)
    for trial in range(20):
        window, hysteresis = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3])
        cfg = FP16Config(enabled=True, initial_scale_power=6, loss_scale_window=window, hysteresis=hysteresis,
                         consecutive_hysteresis=consecutive, min_loss_scale=1.0)
        ours = LossScaler(cfg)
        theirs = DynamicLossScaler(init_scale=2.0 ** 6, scale_window=window, min_scale=1.0,
                                   delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                                   raise_error_at_min_scale=False, dtype=torch.float16)
        for step in range(200):
            overflow = rng.random() < (0.5 if trial % 2 else 0.15)
            ours.update(overflow)
            theirs.update_scale(overflow)
            assert (ours.scale, ours.hysteresis_left) == (theirs.cur_scale, theirs.cur_hysteresis), (trial, step)
            assert ours.good_steps == theirs.cur_iter - theirs.last_overflow_iter - 1


def test_static_scale_never_changes() -> None:
    s = LossScaler(FP16Config(enabled=True, loss_scale=128.0))
    s.update(overflow=True)
    s.update(overflow=False)
    assert s.scale == 128.0 and not s.dynamic


def test_cast_floating_only_touches_float_tensors() -> None:
    args = (torch.ones(2), torch.arange(3), {"m": [torch.zeros(1, dtype=torch.float64)], "s": "x"})
    out = cast_floating(args, torch.bfloat16)
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.int64
    assert out[2]["m"][0].dtype == torch.bfloat16 and out[2]["s"] == "x"
