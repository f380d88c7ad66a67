"""An EngineState in format terms: the tensors every rank writes and the manifest's fields.

Every rank computes the same list of TensorSpecs (names, shapes, dtypes, layouts; names per
zeroshard/format/training_state.py) and holds the data of its own ranges: the fp32 master
fragment of each parameter, the per-element optimizer state of the same range, buffers (written
by rank 0) and its rank-state blob. Scalar optimizer state (Adam's `step`) and everything else
that is not a tensor goes into the manifest as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zeroshard.checkpointing.staging import Staging
from zeroshard.checkpointing.stateful import to_json_value
from zeroshard.engine.contract import EngineState
from zeroshard.format.training_state import optimizer_key, rank_state_key, scalar_json
from zeroshard.format.writer import TensorSpec
from zeroshard.storage.safetensors_header import dtype_name


@dataclass
class Held:
    """A 1-D tensor holding a global tensor's elements [start, start + numel)."""

    tensor: torch.Tensor
    start: int


@dataclass
class RankContents:
    """What one rank writes (`held`, for the shared `specs`) and, from rank 0, the manifest fields.

    `held` tensors are live references to the engine's memory. `stepped` names those that only
    an optimizer step changes (masters, per-element optimizer state); the others (buffers) may
    change in any forward."""

    specs: list[TensorSpec]
    held: dict[str, Held]
    stepped: set[str]
    manifest_fields: dict[str, Any]
    staging: Staging | None = field(default=None, repr=False)  # device tensors' way out, made on first use

    def list_rank_states(self, sizes: list[int]) -> None:
        """Add every rank's rank-state blob (`sizes`, exchanged between the ranks) to the specs,
        so that all ranks list the same tensors."""
        for rank, size in enumerate(sizes):
            if size:  # ranks without per-rank Stateful objects store nothing
                self.specs.append(TensorSpec(rank_state_key(rank), "extra", "U8", (size,), "local", owner=rank))

    def fill(self, spec: TensorSpec, start: int, end: int, write: Callable[[memoryview], None]) -> None:
        """The format writer's callback: the bytes of elements [start, end) of `spec`."""
        held = self.held[spec.name]
        part = held.tensor[start - held.start:end - held.start]
        if part.device.type == "cpu":
            write(memoryview(part.contiguous().view(torch.uint8).numpy()))
            return
        if self.staging is None:
            self.staging = Staging(part.device)
        for window in self.staging.windows(part):  # write-behind safe: see Staging.windows
            write(window)


def engine_contents(state: EngineState, rank_state: bytes) -> RankContents:
    """This rank's contents, as live references; `rank_state`: its rank-state blob. The specs
    are complete once `list_rank_states` has every rank's blob size."""
    specs: list[TensorSpec] = []
    held: dict[str, Held] = {}
    stepped: set[str] = set()
    scalar_state: dict[str, dict[str, Any]] = {}

    def hold(name: str, tensor: torch.Tensor, start: int) -> None:
        held[name] = Held(tensor.detach().reshape(-1), start)

    for info in state.params:
        layout = "flat" if info.shape else "whole"
        specs.append(TensorSpec(info.name, "param", "F32", tuple(info.shape), layout))
        hold(info.name, info.fragment, info.start)
        stepped.add(info.name)
        for key, value in info.tensor_state.items():
            name = optimizer_key(key, info.name)
            specs.append(TensorSpec(name, "optimizer", dtype_name(value.dtype), tuple(info.shape), layout,
                                    param=info.name, state=key))
            hold(name, value[: info.end - info.start], info.start)
            stepped.add(name)
        if info.scalar_state:
            scalar_state[info.name] = {k: scalar_json(v, f"optimizer state {k!r} of {info.name!r}")
                                       for k, v in info.scalar_state.items()}
    for buf in state.buffers:
        specs.append(TensorSpec(buf.name, "buffer", dtype_name(buf.dtype), tuple(buf.tensor.shape), "whole"))
        if state.rank == 0:
            hold(buf.name, buf.tensor if buf.tensor.dtype == buf.dtype else buf.tensor.to(buf.dtype), 0)
    if rank_state:
        hold(rank_state_key(state.rank), torch.frombuffer(bytearray(rank_state), dtype=torch.uint8), 0)
    return RankContents(specs, held, stepped, _manifest_fields(state, scalar_state) if state.rank == 0 else {})


def _manifest_fields(state: EngineState, scalar_state: dict[str, Any]) -> dict[str, Any]:
    groups = [{**to_json_value(dict(g.options), "optimizer hyperparameters"), "params": list(g.params)}
              for g in state.param_groups or ()]
    counters = state.counters
    engine = {"zero_stage": state.zero_stage, "world_size": state.world_size,
              "shard_world_size": state.shard_world_size,
              "global_steps": counters.global_steps if counters else 0,
              "micro_steps": counters.micro_steps if counters else 0,
              "skipped_steps": counters.skipped_steps if counters else 0,
              "loss_scaler": to_json_value(dict(state.loss_scaler or {}), "loss scaler"),
              "optimizer_class": state.optimizer_class.rsplit(".", 1)[-1]}
    return {"zero_stage": state.zero_stage, "step": counters.global_steps if counters else 0,
            "dtypes": {"compute": dtype_name(state.compute_dtype), "master": "F32"},
            "optimizer": {"class": state.optimizer_class, "param_groups": groups, "scalar_state": scalar_state},
            "aliases": dict(state.aliases), "extra": {"engine": engine}}
