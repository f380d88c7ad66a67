"""The engine's configuration: dataclasses mirroring the DeepSpeed JSON layout.

`ZeroConfig.coerce` accepts a ZeroConfig, a DeepSpeed-style dict, or a path to a JSON file.
Unknown keys are errors that name the key (with a close match when there is one); DeepSpeed
keys we knowingly do not implement are accepted with one warning that lists them all.
`digest()` is a stable hash of the settings every rank must agree on (checked at initialize).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from zeroshard.engine.param_offload import check_spec as check_param_offload
from zeroshard.errors import ConfigError

# DeepSpeed keys accepted but ignored (one warning lists those present).
IGNORED_TOP_KEYS = frozenset({
    "steps_per_print", "wall_clock_breakdown", "dump_state", "zero_allow_untested_optimizer",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comms_logger", "activation_checkpointing",
    "checkpoint", "aio", "memory_breakdown", "zero_force_ds_cpu_optimizer",
    "seq_parallel_communication_data_type", "timers", "monitor_config", "compile",
})
IGNORED_ZERO_KEYS = frozenset({
    "contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "sub_group_size", "elastic_checkpoint",
    "ignore_unused_parameters", "load_from_fp32_weights", "memory_efficient_linear",
    "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory", "use_multi_rank_bucket_allreduce",
})
IGNORED_FP16_KEYS = frozenset({"auto_cast", "fp16_master_weights_and_grads"})
IGNORED_DATA_TYPES_KEYS = frozenset({"grad_accum_dtype", "param_dtype", "keep_in_fp32_modules"})
IGNORED_BF16_KEYS = frozenset({"immediate_grad_update", "check_grad_overflow"})
# DeepSpeed sections that would change behaviour if silently ignored.
REFUSED_TOP_KEYS = {
    "optimizer": "build the optimizer yourself and pass it to zeroshard.initialize",
    "scheduler": "attach a torch.optim.lr_scheduler to engine.optimizer",
    "amp": "apex AMP is not supported; use \"bf16\" or \"fp16\"",
}

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@dataclass
class ZeroOptimizationConfig:
    stage: int = 0
    # Elements per gradient bucket (whole-gradient elements, i.e. world_size x the shard). 5M fp32
    # elements is 20 MB, about DDP's 25 MB bucket. At 57M parameters on gloo (tools/bench_train.py)
    # 25M-element buckets overlapped little: stage 1/2 steps took 1.58x/1.62x DDP's, 1.16x/1.14x now.
    reduce_bucket_size: int = 5_000_000
    # Elements per parameter all-gather bucket after a stage-1/2 step (finished by the next
    # forward's pre-hooks, so smaller buckets let the forward start sooner).
    allgather_bucket_size: int = 5_000_000
    # Launch gradient collectives asynchronously while backward still runs.
    overlap_comm: bool = True
    # Stage 3: gather the next unit (in recorded execution order) while the current one runs.
    stage3_prefetch: bool = True
    # Stage 3: module class names whose instances are gathered as one unit.
    stage3_unit_classes: list[str] = field(default_factory=list)
    # Stage 3 (Python config only): True for modules that should be one unit.
    unit_predicate: Callable[[torch.nn.Module], bool] | None = field(default=None, compare=False)
    offload_optimizer: dict[str, Any] | None = None
    offload_param: dict[str, Any] | None = None
    # Stage 3, ZeRO++ hpZ: ranks per secondary parameter partition (ranks of one node); the
    # forward/backward gathers stay inside it (1: off). See engine/hpz.py.
    zero_hpz_partition_size: int = 1


@dataclass
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0 selects dynamic loss scaling
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class DataTypesConfig:
    # Buffers (rotary frequencies, normalization statistics) keep the dtype they arrive in, as
    # DeepSpeed (>= 0.19) and FSDP2 leave them: a rotary `inv_freq` rounded to bf16 turns into an
    # angle error that grows with the position. A dtype here casts every floating buffer to it.
    buffer_dtype: str | None = None


@dataclass
class ZeroConfig:
    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    bf16: BF16Config = field(default_factory=BF16Config)
    fp16: FP16Config = field(default_factory=FP16Config)
    gradient_accumulation_steps: int | None = None  # None: 1, or derived from train_batch_size
    gradient_clipping: float = 0.0  # max global grad norm; 0 disables
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    communication_data_type: str | None = None  # gradient reduction dtype; default fp32
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def coerce(cls, config: "ZeroConfig | Mapping[str, Any] | str | os.PathLike | None") -> "ZeroConfig":
        """Accept a ZeroConfig, a DeepSpeed-style dict, a JSON path, or None (defaults)."""
        if config is None:
            cfg = cls()
        elif isinstance(config, ZeroConfig):
            cfg = config
        elif isinstance(config, Mapping):
            cfg = cls.from_dict(config)
        elif isinstance(config, (str, os.PathLike)):
            with open(config, encoding="utf-8") as f:
                cfg = cls.from_dict(json.load(f))
        else:
            raise ConfigError(f"config must be a ZeroConfig, dict or JSON path, not {type(config).__name__}")
        cfg.validate()
        return cfg

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ZeroConfig":
        ignored: list[str] = []
        for key, why in REFUSED_TOP_KEYS.items():
            if key in data:
                raise ConfigError(f"config key {key!r} is not supported: {why}")
        cfg = _build(cls, data, "", {"": IGNORED_TOP_KEYS, "zero_optimization": IGNORED_ZERO_KEYS,
                                     "fp16": IGNORED_FP16_KEYS, "bf16": IGNORED_BF16_KEYS,
                                     "data_types": IGNORED_DATA_TYPES_KEYS}, ignored)
        if ignored:
            warnings.warn("zeroshard ignores these DeepSpeed config keys: " + ", ".join(sorted(ignored)),
                          UserWarning, stacklevel=3)
        return cfg

    # -- checks and derived values ------------------------------------------------------------

    def validate(self) -> None:
        z = self.zero_optimization
        if z.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {z.stage!r}")
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if int(getattr(z, key)) < 1:
                raise ConfigError(f"zero_optimization.{key} must be >= 1")
        check_param_offload(z.offload_param, z.stage)
        hpz = z.zero_hpz_partition_size
        if isinstance(hpz, bool) or not isinstance(hpz, int) or hpz < 1:
            raise ConfigError(f"zero_optimization.zero_hpz_partition_size must be an integer >= 1, got {hpz!r}")
        if hpz > 1 and z.stage != 3:
            raise ConfigError("zero_optimization.zero_hpz_partition_size > 1 (hpZ) needs stage 3")
        if hpz > 1 and (z.offload_param or {}).get("device", "none") not in (None, "none"):
            raise ConfigError("zero_optimization.zero_hpz_partition_size > 1 with offload_param is not supported: "
                              "hpZ keeps its secondary partition on the device")
        spec = z.offload_optimizer or {}
        unknown = sorted(set(spec) - {"device", "pin_memory", "buffer_count", "fast_init", "ratio", "nvme_path"})
        if unknown:
            raise ConfigError(f"unknown config key 'zero_optimization.offload_optimizer.{unknown[0]}'")
        device = spec.get("device", "none")
        if device not in (None, "none", "cpu"):
            raise ConfigError(f"zero_optimization.offload_optimizer.device={device!r}: only 'cpu' (or 'none') "
                              "is supported")
        if device == "cpu" and z.stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer needs stage 1, 2 or 3")
        if not isinstance(spec.get("pin_memory", False), bool):
            raise ConfigError("zero_optimization.offload_optimizer.pin_memory must be true or false")
        if self.bf16.enabled and self.fp16.enabled:
            raise ConfigError("bf16.enabled and fp16.enabled are mutually exclusive")
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps < 1:
            raise ConfigError("gradient_accumulation_steps must be >= 1")
        if self.gradient_clipping < 0:
            raise ConfigError("gradient_clipping must be >= 0")
        if self.communication_data_type is not None and self.communication_data_type not in _DTYPES:
            raise ConfigError(f"communication_data_type must be one of {sorted(_DTYPES)}, "
                              f"got {self.communication_data_type!r}")
        if self.data_types.buffer_dtype is not None and self.data_types.buffer_dtype not in _DTYPES:
            raise ConfigError(f"data_types.buffer_dtype must be one of {sorted(_DTYPES)} (or null: buffers keep their "
                              f"dtype), got {self.data_types.buffer_dtype!r}")
        f = self.fp16
        if f.loss_scale < 0 or f.loss_scale_window < 1 or f.hysteresis < 1 or f.min_loss_scale <= 0:
            raise ConfigError("fp16: need loss_scale >= 0, loss_scale_window >= 1, hysteresis >= 1, "
                              "min_loss_scale > 0")

    def check_for_inference(self) -> None:
        """An engine without an optimizer: stages 1-2 shard only what an optimizer needs."""
        if self.stage in (1, 2):  # as DeepSpeed: "zero stage N requires an optimizer"
            raise ConfigError(f"zero_optimization.stage {self.stage} shards optimizer state (and gradients), and no "
                              "optimizer was given: for a model used only for inference use stage 3 (parameters "
                              "sharded) or 0")

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of the module's parameters during forward/backward."""
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    @property
    def buffer_dtype(self) -> torch.dtype | None:
        """Dtype floating buffers are cast to (None: they keep their own)."""
        name = self.data_types.buffer_dtype
        return _DTYPES[name] if name is not None else None

    @property
    def reduce_dtype(self) -> torch.dtype:
        """Dtype gradients are communicated (and summed) in."""
        return _DTYPES[self.communication_data_type] if self.communication_data_type else torch.float32

    def resolve_accumulation(self, world_size: int) -> int:
        """gradient_accumulation_steps, derived from / checked against the batch sizes."""
        gas, micro, total = self.gradient_accumulation_steps, self.train_micro_batch_size_per_gpu, self.train_batch_size
        if total is not None and micro is not None:
            if gas is None:
                if total % (micro * world_size):
                    raise ConfigError(f"train_batch_size={total} is not divisible by "
                                      f"train_micro_batch_size_per_gpu={micro} x world_size={world_size}")
                gas = total // (micro * world_size)
            if total != micro * gas * world_size:
                raise ConfigError(f"train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
                                  f"gradient_accumulation_steps={gas} x world_size={world_size}")
        return gas or 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-able settings (the predicate is represented by its presence only)."""
        d = dataclasses.asdict(self)
        d["zero_optimization"]["unit_predicate"] = self.zero_optimization.unit_predicate is not None
        return d

    def digest(self) -> int:
        """63-bit hash of the settings; equal on every rank of a correctly launched job."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _build(cls: type, data: Mapping[str, Any], path: str, ignored_by_path: dict[str, frozenset],
           ignored: list[str]) -> Any:
    """Build dataclass `cls` from `data`, recursing into nested dataclass fields."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config key {path or '<root>'!r} must be an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "unit_predicate"}
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else key
        if key not in fields:
            if key in ignored_by_path.get(path, ()):
                ignored.append(full)
                continue
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {full!r}{hint}")
        if value == "auto":
            raise ConfigError(f"config key {full!r} is 'auto': give a concrete value")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = _build(kind, value, full, ignored_by_path, ignored)
        else:
            kwargs[key] = _check_value(full, value, kind)
    return cls(**kwargs)


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_value(key: str, value: Any, kind: Any) -> Any:
    """Light type check: bools are not ints, ints are accepted for floats, None where allowed."""
    is_union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    allowed = typing.get_args(kind) if is_union else (kind,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        base = typing.get_origin(t) or t
        if base is bool and isinstance(value, bool):
            return value
        if (base is int and isinstance(value, (int, float)) and not isinstance(value, bool)
                and float(value).is_integer()):
            return int(value)  # DeepSpeed configs often write 5e8
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base in (str, list, dict) and isinstance(value, base):
            return value
    raise ConfigError(f"config key {key!r} has the wrong type: {value!r}")
