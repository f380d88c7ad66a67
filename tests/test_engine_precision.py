"""Loss scaling rules (DeepSpeed's DynamicLossScaler semantics) and input casting."""

from __future__ import annotations

import torch

from zeroshard.engine.config import FP16Config
from zeroshard.engine.precision import LossScaler, cast_floating


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
    assert s.scale == 8.0
    for _ in range(5):
        s.update(overflow=True)
    assert s.scale == 2.0
    state = s.state_dict()
    other = LossScaler(FP16Config(enabled=True))
    other.load_state_dict(state)
    assert other.scale == 2.0


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
