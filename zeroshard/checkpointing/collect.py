"""What an engine checkpoint holds, gathered from one rank's engine, in format terms.

Every rank computes the same list of TensorSpecs (names, shapes, dtypes, layouts) and holds the
data of its own ranges: the fp32 master fragment of each parameter, the per-element optimizer
state of the same range, buffers (written by rank 0), and its RNG states. Scalar optimizer state
(Adam's `step`) and everything else that is not a tensor goes into the manifest as JSON.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from zeroshard.format.writer import TensorSpec
from zeroshard.storage.safetensors_header import dtype_name

if TYPE_CHECKING:
    from zeroshard.engine import ZeroEngine


def optimizer_key(state: str, param: str) -> str:
    return f"optimizer/{state}/{param}"


def rng_key(rank: int, device: str) -> str:
    return f"rng/rank-{rank:05d}/{device}"


@dataclass
class Held:
    """A 1-D tensor holding a global tensor's elements [start, start + numel)."""

    tensor: torch.Tensor
    start: int


@dataclass
class LocalState:
    specs: list[TensorSpec]
    held: dict[str, Held]
    aliases: dict[str, str]
    scalar_state: dict[str, dict[str, Any]]  # param -> state key -> {"dtype"?, "value"}
    optimizer_class: str
    engine_state: dict[str, Any]
    python_rng: dict[str, Any] = field(default_factory=dict)


def to_json_value(value: Any, what: str) -> Any:
    """Hyperparameters and counters as plain JSON (tuples -> lists, 0-d tensors -> numbers)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, what) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json_value(v, what) for k, v in value.items()}
    if torch.is_tensor(value) and value.dim() == 0:
        return value.item()
    raise TypeError(f"{what}: {type(value).__name__} value {value!r} cannot be stored as JSON")


def _scalar_json(value: Any, what: str) -> dict[str, Any]:
    if torch.is_tensor(value):
        return {"dtype": dtype_name(value.dtype), "value": value.item()}
    return {"value": to_json_value(value, what)}


def collect(engine: "ZeroEngine", snapshot: bool, staging: dict[str, torch.Tensor] | None = None) -> LocalState:
    """This rank's checkpoint content. snapshot=True copies every tensor to CPU (pinned memory
    on CUDA) so training may go on while a background thread writes it.

    `staging` keeps those copies between saves: allocating (and first touching) fresh memory
    costs several times more than copying into memory used before, and it is what training
    waits for. Safe because a save always waits for the previous one first.
    """
    staging = {} if staging is None else staging
    specs: list[TensorSpec] = []
    held: dict[str, Held] = {}
    scalar_state: dict[str, dict[str, Any]] = {}
    pin = snapshot and engine.device.type == "cuda"

    def keep(name: str, tensor: torch.Tensor, start: int) -> None:
        tensor = tensor.detach().reshape(-1)
        if snapshot or tensor.device.type != "cpu":
            copy = staging.get(name) if snapshot else None
            if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
                if snapshot:
                    staging[name] = copy
            copy.copy_(tensor, non_blocking=pin)
            tensor = copy
        held[name] = Held(tensor, start)

    for name, info in engine.named_shards():
        specs.append(TensorSpec(name, "param", "F32", tuple(info.shape), "flat" if info.shape else "whole"))
        keep(name, info.fragment, info.start)
        for key, value in info.tensor_state.items():
            specs.append(TensorSpec(optimizer_key(key, name), "optimizer", dtype_name(value.dtype), tuple(info.shape),
                                    "flat" if info.shape else "whole", param=name, state=key))
            keep(optimizer_key(key, name), value[: info.end - info.start], info.start)
        if info.scalar_state:
            scalar_state[name] = {k: _scalar_json(v, f"optimizer state {k!r} of {name!r}")
                                  for k, v in info.scalar_state.items()}

    aliases: dict[str, str] = {}
    for key, value in engine.module.state_dict(keep_vars=True).items():
        shard = engine._shard_by_param.get(id(value))
        if shard is not None:
            if shard.name != key:
                aliases[key] = shard.name
        elif torch.is_tensor(value):
            dtype = engine._buffer_dtypes.get(key, value.dtype)
            specs.append(TensorSpec(key, "buffer", dtype_name(dtype), tuple(value.shape), "whole"))
            if engine.rank == 0:
                keep(key, value.detach().to(dtype), 0)

    rank = engine.rank
    cpu_rng = torch.get_rng_state()
    devices = [("cpu", cpu_rng)]
    if engine.device.type == "cuda":
        devices.append(("cuda", torch.cuda.get_rng_state(engine.device)))
    for world_rank in range(engine.world_size):
        for device, state in devices:
            specs.append(TensorSpec(rng_key(world_rank, device), "extra", "U8", tuple(state.shape), "local",
                                    owner=world_rank))
    for device, state in devices:
        held[rng_key(rank, device)] = Held(state.clone(), 0)

    cls = type(engine.optimizer)
    engine_state = to_json_value(engine.engine_state(), "engine state")
    np_state = np.random.get_state()
    python_rng = {"python": to_json_value(random.getstate(), "python rng"),
                  "numpy": [np_state[0], np_state[1].tolist(), *[to_json_value(v, "numpy rng") for v in np_state[2:]]]}
    return LocalState(specs, held, aliases, scalar_state, f"{cls.__module__}.{cls.__qualname__}", engine_state,
                      python_rng)
