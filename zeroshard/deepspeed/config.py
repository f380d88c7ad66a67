"""Splitting a DeepSpeed config into what the native engine takes and what this layer handles.

The native ZeroConfig refuses "optimizer" and "scheduler" (it never builds them); here they
are built (optimizers.py, lr_schedules.py). The batch sizes are resolved as DeepSpeed does,
and "gradient_clipping" defaults to DeepSpeed's 1.0 (GRADIENT_CLIPPING_DEFAULT), not the native 0.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from zeroshard.errors import ConfigError

GRADIENT_CLIPPING_DEFAULT = 1.0
_LAYER_KEYS = ("optimizer", "scheduler", "dataloader_drop_last")


@dataclass
class SplitConfig:
    engine: dict[str, Any]  # for zeroshard.initialize
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    micro_batch: int
    gradient_accumulation_steps: int
    train_batch_size: int
    dataloader_drop_last: bool
    raw: dict[str, Any]


def load_config(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    raise ConfigError(f"config must be a dict or a JSON file path, not {type(config).__name__}")


def batch_sizes(cfg: Mapping[str, Any], world: int) -> tuple[int, int, int]:
    """(train_batch_size, micro batch per GPU, gradient accumulation steps), as DeepSpeed fills them in."""
    total, micro, gas = cfg.get("train_batch_size"), cfg.get("train_micro_batch_size_per_gpu"), \
        cfg.get("gradient_accumulation_steps")
    if total is None and micro is None:
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    if total is not None and micro is not None:
        gas = gas if gas is not None else total // (micro * world)
    elif total is not None:
        gas = gas or 1
        micro = total // (gas * world)
    else:
        gas = gas or 1
        total = micro * gas * world
    if total != micro * gas * world or micro < 1:
        raise ConfigError(f"train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
                         f"gradient_accumulation_steps={gas} x world_size={world}")
    return int(total), int(micro), int(gas)


def split_config(config: Any, world: int) -> SplitConfig:
    raw = load_config(config)
    total, micro, gas = batch_sizes(raw, world)
    engine = {k: v for k, v in raw.items() if k not in _LAYER_KEYS}
    engine.update(train_batch_size=total, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
    engine.setdefault("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    return SplitConfig(engine, raw.get("optimizer"), raw.get("scheduler"), micro, gas, total,
                       bool(raw.get("dataloader_drop_last", False)), raw)
