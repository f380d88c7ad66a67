"""The engine's checkpoint contract: everything a checkpoint holds of an engine, as typed values.

`ZeroEngine.checkpoint_state()` returns an EngineState of *live* references (no copies): the
fp32 master chunk and optimizer state of every parameter this rank owns (ShardInfo, layout.py),
the module's buffers with the dtype to store them in, tied-parameter aliases, counters, the loss
scaler and the optimizer's param groups by member name. `ZeroEngine.restore(state)` applies
one; a checkpointer builds it from `checkpoint_state()` with the tensors it read. This is the only
way checkpoint code reaches into an engine (tests/test_layering.py checks), so the engine
never needs to know about files, and a checkpointer never about the engine's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from zeroshard.engine.layout import ShardInfo


@dataclass(frozen=True)
class BufferState:
    """A module buffer: `tensor` (live, in the compute dtype) and the dtype it is stored in
    (its own dtype before the engine cast it)."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class Counters:
    global_steps: int  # optimizer steps taken
    micro_steps: int  # step() calls
    skipped_steps: int  # fp16 overflows


@dataclass(frozen=True)
class ParamGroup:
    """One optimizer param group: its members by parameter name, and its hyperparameters."""

    params: tuple[str, ...]
    options: Mapping[str, Any]


@dataclass(frozen=True)
class EngineState:
    """One rank's engine state. For `restore`, any of `params` and `buffers` may be a subset
    (strict=False), and `counters`, `loss_scaler`, `param_groups` may be None (left as they are)."""

    zero_stage: int
    world_size: int
    rank: int
    shard_world_size: int  # the partition's world size: 1 at stage 0
    device: torch.device
    compute_dtype: torch.dtype
    optimizer_class: str  # "module.QualifiedName" of the torch optimizer
    params: tuple[ShardInfo, ...]  # unique parameters, named_parameters() order
    buffers: tuple[BufferState, ...]
    aliases: Mapping[str, str]  # state_dict name of a tied parameter -> the name it is stored under
    counters: Counters | None
    loss_scaler: Mapping[str, Any] | None
    param_groups: tuple[ParamGroup, ...] | None
