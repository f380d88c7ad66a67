"""DeepSpeed's learning-rate schedules, with DeepSpeed's exact arithmetic.

Ported from deepspeed/runtime/lr_schedules.py (Apache-2.0, DeepSpeed 0.19): WarmupLR,
WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest. Their quirks are kept on purpose,
because losses depend on them: construction already sets the LR for `last_batch_iteration=-1`
(the minimum), the first step() sets iteration 0 (still the minimum for the warmups), warmup
lengths below 2 become 2, and OneCycle cycles Adam's beta1 with beta2 fixed at 0.99.
The engine (zeroshard.deepspeed) calls step() after every applied optimizer step, as DeepSpeed.
State is `{"last_batch_iteration": n}`, as DeepSpeed's, so it survives a checkpoint as JSON.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import torch

from zeroshard.errors import ConfigError, EngineUsageError

WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "log", "linear"


def update_lr(param_groups: list[dict], lrs: Sequence[float]) -> list[float]:
    for group, lr in zip(param_groups, lrs):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr.squeeze() if torch.is_tensor(lr) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in param_groups]


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ConfigError(f"expected {len(optimizer.param_groups)} values for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _warmup_type(kind: str) -> str:
    if kind not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        warnings.warn(f"unknown warmup_type {kind!r}: using 'log' (as DeepSpeed)", stacklevel=3)
        return WARMUP_LOG_RATE
    return kind


class _Schedule:
    optimizer: torch.optim.Optimizer
    last_batch_iteration: int

    def get_lr(self) -> list[float]:
        raise NotImplementedError  # internal: abstract; every scheduler here defines get_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._last_lr = update_lr(self.optimizer.param_groups, self.get_lr())

    def get_last_lr(self) -> list[float]:
        if getattr(self, "_last_lr", None) is None:
            raise EngineUsageError("need to call step() first")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupLR(_Schedule):
    """min_lr -> max_lr over warmup_num_steps (log or linear), then max_lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE, last_batch_iteration: int = -1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ConfigError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = update_lr(optimizer.param_groups, self.get_lr())

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return self.min_lrs
        gamma = self._get_gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]

    def _warmup_gamma(self) -> float:
        if self.warmup_type == WARMUP_LOG_RATE:
            return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
        return self.last_batch_iteration / self.warmup_num_steps

    def _get_gamma(self) -> float:
        return self._warmup_gamma() if self.last_batch_iteration < self.warmup_num_steps else 1.0


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}",
                          stacklevel=2)

    def _get_gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_gamma()
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """Ratio warmup_min_ratio -> 1 over warmup_num_steps, then cosine to cos_min_ratio (times each group's lr)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = WARMUP_LOG_RATE,
                 last_batch_iteration: int = -1):
        if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ConfigError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps}")
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}",
                          stacklevel=2)
        self.org_lrs = [g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = update_lr(optimizer.param_groups, self.get_lr())

    def get_lr_ratio(self) -> float:
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == WARMUP_LOG_RATE:
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            else:
                ratio = self.last_batch_iteration / self.warmup_num_steps
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """1Cycle: LR up from cycle_min_lr to cycle_max_lr and back, then optional decay; Adam's
    beta1 cycles the other way between cycle_max_mom and cycle_min_mom."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ConfigError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ConfigError(f"cycle_second_step_size must be non-negative, got {second}")
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_step_size, self.second_step_size = first, second
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.skip_lr_decay = self.skip_mom_decay = math.isclose(decay_step_size, 0)

        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            update_lr(optimizer.param_groups, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        if math.isclose(decay_lr_rate, 0):
            self.skip_lr_decay = True

        self.cycle_momentum = cycle_momentum
        if cycle_momentum:
            if "betas" not in optimizer.defaults:
                warnings.warn(f"cycle_momentum disabled: {type(optimizer).__name__} has no betas", stacklevel=2)
                self.cycle_momentum = False
            else:
                self.decay_mom_rate = decay_mom_rate
                self.min_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
                self.max_moms = [(m, 0.99) for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
                if last_batch_iteration == -1:
                    for momentum, group in zip(self.min_moms, optimizer.param_groups):
                        group["betas"] = momentum
                if math.isclose(decay_mom_rate, 0):
                    self.skip_mom_decay = True
        self.last_batch_iteration = last_batch_iteration

    def _get_scale_factor(self) -> float:
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale_factor, stair_count = x / self.step_ratio, self.first_stair_count
        else:
            scale_factor, stair_count = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stair_count > 0:
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= self.first_step_size:
                position = cycle_iteration * stair_count / self.first_step_size
            else:
                position = (self.total_size - cycle_iteration) * stair_count / self.second_step_size
            scale_factor = math.floor(position) / stair_count
        return scale_factor

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return self.min_lrs
        factor = 1 + self.decay_lr_rate * (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._get_scale_factor()
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return self.max_moms
        factor = 1 + self.decay_mom_rate * (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, momentum in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = momentum


class LRRangeTest(_Schedule):
    """LR grows from lr_range_test_min_lr by step_rate every step_size steps (continuous or staircase)."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ConfigError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size}")
        self.optimizer = optimizer
        self.min_lr = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = update_lr(optimizer.param_groups, self.min_lr)

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        increase = 1 + self.step_rate * (math.floor(interval) if self.staircase else interval)
        return [lo * increase for lo in self.min_lr]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
             "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_scheduler(section: dict[str, Any], optimizer: torch.optim.Optimizer) -> _Schedule:
    """The config's "scheduler": {"type": ..., "params": {...}} over `optimizer`."""
    kind = section.get("type")
    if kind not in SCHEDULES:
        raise ConfigError(f"scheduler type {kind!r} is not supported (supported: {', '.join(SCHEDULES)})")
    return SCHEDULES[kind](optimizer, **dict(section.get("params") or {}))
