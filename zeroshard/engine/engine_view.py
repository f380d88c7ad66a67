"""EngineView: what state.py and memory.py may read of an engine, as public names only.

ZeroEngine satisfies it; the two modules type against this Protocol instead of importing the
engine, so the engine's files form no import circle and nothing outside the class reads its
private fields.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from zeroshard.engine.layout import ParamShard


class EngineView(Protocol):
    module: nn.Module
    optimizer: Any
    config: Any
    device: torch.device
    rank: int
    world_size: int
    shard_world_size: int
    stage: int
    group: Any
    compute_dtype: torch.dtype
    shards: list[ParamShard]
    scaler: Any
    reducer: Any
    param_tier: Any  # param_offload.py: update() after the masters change
    global_steps: int
    micro_steps: int
    skipped_steps: int

    @property
    def param_gather_group(self) -> Any: ...  # the process group of parameter all-gathers

    @property
    def buffer_dtypes(self) -> dict[str, torch.dtype]: ...  # buffer name -> dtype before the engine's cast

    @property
    def stage3_scheduler(self) -> Any: ...

    @property
    def param_refresh(self) -> Any: ...

    def shard_of(self, param: torch.Tensor) -> ParamShard | None: ...

    def wait_params(self) -> None: ...
