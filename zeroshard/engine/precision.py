"""Mixed precision: casting the module and its inputs, and fp16 loss scaling.

Compute happens in the config's compute dtype (bf16, fp16 or fp32); master weights, optimizer
state and reduced gradients are always fp32. fp16 additionally needs loss scaling: the loss is
multiplied by `scale` before backward, the gradients divided by it before the step; a
non-finite gradient anywhere (checked across all ranks by the engine) skips the step and lowers
the scale. The rules follow DeepSpeed's DynamicLossScaler, including `hysteresis` (that many
overflows in a row before the scale drops) so DeepSpeed configs behave the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zeroshard.engine.config import FP16Config


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a (nested) structure of inputs to `dtype`."""
    def cast(x: Any) -> Any:
        if torch.is_tensor(x) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    return tree_map(cast, tree)


def cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """Cast floating buffers to `dtype` (config data_types.buffer_dtype; None: leave them, as
    DeepSpeed and FSDP2 do); return the old dtypes of those cast."""
    old: dict[str, torch.dtype] = {}
    if dtype is None:
        return old
    for name, buf in module.named_buffers():
        if buf.is_floating_point() and buf.dtype != dtype:
            old[name] = buf.dtype
            buf.data = buf.data.to(dtype)
    return old


class LossScaler:
    """Static or dynamic loss scale (scale 1 and never an overflow when disabled)."""

    def __init__(self, cfg: FP16Config) -> None:
        self.enabled = cfg.enabled
        self.dynamic = cfg.enabled and cfg.loss_scale == 0
        self.scale = (2.0 ** cfg.initial_scale_power if self.dynamic else cfg.loss_scale) if cfg.enabled else 1.0
        self.window = cfg.loss_scale_window
        self.min_scale = cfg.min_loss_scale
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.hysteresis_left = cfg.hysteresis
        self.good_steps = 0  # steps without an overflow since the last one (or the start)

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step attempt, as DeepSpeed's DynamicLossScaler.update_scale."""
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.hysteresis_left -= 1
            return
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        # DeepSpeed grows at a good step once a positive multiple of the window of good steps
        # came before it (its `stable_interval`), not at the window-th good step itself
        if self.good_steps > 0 and self.good_steps % self.window == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= 2
        self.good_steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
