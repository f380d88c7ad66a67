"""Splitting a DeepSpeed config into what the native engine takes and what this layer handles.

The native ZeroConfig refuses "optimizer" and "scheduler" (it never builds them); here they
are built (optimizers.py, lr_schedules.py). The batch sizes are resolved as DeepSpeed does,
and "gradient_clipping" defaults to DeepSpeed's 1.0 (GRADIENT_CLIPPING_DEFAULT), not the native 0.
The offload sections of "zero_optimization" are mapped by `map_offload` (DeepSpeed's deprecated
booleans included); keys that would change behaviour are refused with one line naming them.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

from zeroshard.errors import ConfigError, UnsupportedFeatureError

GRADIENT_CLIPPING_DEFAULT = 1.0
# DeepSpeed's offload_optimizer keys with the value that is the only one zeroshard runs (its
# defaults: anything else would be silently different behaviour), mapped away before the engine.
_OPTIMIZER_OFFLOAD_DEFAULTS = {"super_offload": False, "ratio": 1.0}
# Read by DeepSpeed only with super_offload or with the optimizer swapped to NVMe (refused).
_OPTIMIZER_OFFLOAD_DROPPED = ("cpuadam_cores_perc", "fast_init", "pipeline_read", "pipeline_write")
# DeepSpeed's deprecated booleans (deepspeed/runtime/zero/config.py) -> the section they stand for.
_DEPRECATED_OFFLOAD = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
_LAYER_KEYS = ("optimizer", "scheduler", "dataloader_drop_last")
# DeepSpeed sections that do nothing unless `enabled`: dropped when off, refused when on.
_OFF_UNLESS_ENABLED = {"hybrid_engine": "DeepSpeed-Chat's RLHF generation engine"}


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


def map_offload(zero: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's zero_optimization offload keys as the native engine takes them.

    offload_param (device cpu|nvme|none, nvme_path, pin_memory, buffer_count, buffer_size,
    max_in_cpu) passes through (the engine checks the values); the deprecated `cpu_offload` /
    `cpu_offload_param` booleans become offload_optimizer / offload_param {device: cpu} with
    `cpu_offload_use_pin_memory` as pin_memory; offload_optimizer keys zeroshard has no behaviour
    for are dropped at DeepSpeed's default value and refused otherwise.
    """
    zero = dict(zero)
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    for old, section in _DEPRECATED_OFFLOAD.items():
        if old not in zero:
            continue
        value = zero.pop(old)
        if not isinstance(value, bool):
            raise ConfigError(f"zero_optimization.{old} must be true or false, got {value!r}")
        if value and zero.get(section) is not None:
            raise ConfigError(f"zero_optimization.{old} and zero_optimization.{section} are both given: keep "
                              f"{section} ({old} is DeepSpeed's deprecated form of it)")
        if value:
            zero[section] = {"device": "cpu", "pin_memory": True if pin is None else bool(pin)}
    spec = zero.get("offload_optimizer")
    if isinstance(spec, Mapping):
        spec = dict(spec)
        for key, default in _OPTIMIZER_OFFLOAD_DEFAULTS.items():
            if key in spec and spec[key] != default:
                raise UnsupportedFeatureError(
                    f"zero_optimization.offload_optimizer.{key}={spec[key]!r} (DeepSpeed feature) is not supported "
                    f"by zeroshard.deepspeed: only {default!r}; the whole optimizer is offloaded to the CPU")
            spec.pop(key, None)
        for key in _OPTIMIZER_OFFLOAD_DROPPED:
            spec.pop(key, None)
        if spec.get("device") == "nvme":
            raise UnsupportedFeatureError("zero_optimization.offload_optimizer.device='nvme' (DeepSpeed feature: "
                                          "optimizer state swapped to NVMe) is not supported by zeroshard.deepspeed: "
                                          "use 'cpu' (offload_param supports 'nvme')")
        if spec.get("device", "none") in ("none", None):
            spec.pop("nvme_path", None)  # DeepSpeed configs carry it for every device
        zero["offload_optimizer"] = spec
    return zero


def _drop_dotted_keys(raw: dict[str, Any], warn: bool) -> dict[str, Any]:
    """Top-level keys such as "zero_optimization.reduce_bucket_size" (TRL's prepare_deepspeed adds
    them with dict.update): DeepSpeed reads sections, not dotted names, so it ignores them; so do we,
    saying so, rather than refusing a config DeepSpeed runs."""
    dotted = [k for k in raw if isinstance(k, str) and "." in k]
    if dotted and warn:
        warnings.warn(f"zeroshard.deepspeed: config keys {', '.join(map(repr, dotted))} are ignored, as DeepSpeed "
                      "ignores them (a dotted name at the top level is not a key inside a section)", stacklevel=4)
    return {k: v for k, v in raw.items() if k not in dotted}


def split_config(config: Any, world: int, warn: bool = True) -> SplitConfig:
    raw = _drop_dotted_keys(load_config(config), warn)
    total, micro, gas = batch_sizes(raw, world)
    for key, what in _OFF_UNLESS_ENABLED.items():
        section = raw.get(key)
        if isinstance(section, Mapping) and section.get("enabled", False) is not False:
            raise UnsupportedFeatureError(f"{key}.enabled (DeepSpeed feature: {what}) is not supported by "
                                          "zeroshard.deepspeed")
    engine = {k: v for k, v in raw.items() if k not in _LAYER_KEYS and k not in _OFF_UNLESS_ENABLED}
    if isinstance(engine.get("zero_optimization"), Mapping):
        engine["zero_optimization"] = map_offload(engine["zero_optimization"])
    if isinstance(engine.get("fp16"), Mapping) and "auto_cast" in engine["fp16"]:  # this layer's (initialize.py)
        engine["fp16"] = {k: v for k, v in engine["fp16"].items() if k != "auto_cast"}
    engine.update(train_batch_size=total, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas)
    engine.setdefault("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)
    optimizer = raw.get("optimizer")
    if isinstance(optimizer, Mapping) and "type" in optimizer and optimizer["type"] is None:
        optimizer = None  # {"type": null}: no optimizer, as DeepSpeed reads it (TRL's reference models)
    return SplitConfig(engine, optimizer, raw.get("scheduler"), micro, gas, total,
                       bool(raw.get("dataloader_drop_last", False)), raw)
