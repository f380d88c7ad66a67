"""An EngineState in format terms: the tensors every rank writes and the manifest's fields.

Every rank computes the same list of TensorSpecs (names, shapes, dtypes, layouts; names per
zeroshard/format/training_state.py) and holds the data of its own ranges: the fp32 master
fragment of each parameter, the per-element optimizer state of the same range, buffers (written
by rank 0) and its rank-state blob. Scalar optimizer state (Adam's `step`) and everything else
that is not a tensor goes into the manifest as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.checkpointing.snapshot import Snapshot
from zeroshard.checkpointing.stateful import scalar_json, to_json_value
from zeroshard.engine.contract import EngineState
from zeroshard.format.training_state import optimizer_key, rank_state_key
from zeroshard.format.writer import TensorSpec
from zeroshard.storage.safetensors_header import dtype_name


@dataclass
class Held:
    """A 1-D tensor holding a global tensor's elements [start, start + numel)."""

    tensor: torch.Tensor
    start: int


@dataclass
class RankContents:
    """What one rank writes (`held`, for the shared `specs`) and, from rank 0, the manifest fields."""

    specs: list[TensorSpec]
    held: dict[str, Held]
    manifest_fields: dict[str, Any]


def engine_contents(state: EngineState, rank_state_sizes: list[int], rank_state: bytes,
                    snapshot: Snapshot | None = None) -> RankContents:
    """This rank's contents. `rank_state_sizes`: every rank's rank-state blob size (exchanged
    before, so every rank lists the same specs). With a `snapshot`, tensors are copied into it
    (training may go on while a background thread writes them); else they are live references."""
    specs: list[TensorSpec] = []
    held: dict[str, Held] = {}
    pending: list[tuple[str, torch.Tensor, int]] = []
    scalar_state: dict[str, dict[str, Any]] = {}

    for info in state.params:
        layout = "flat" if info.shape else "whole"
        specs.append(TensorSpec(info.name, "param", "F32", tuple(info.shape), layout))
        pending.append((info.name, info.fragment, info.start))
        for key, value in info.tensor_state.items():
            name = optimizer_key(key, info.name)
            specs.append(TensorSpec(name, "optimizer", dtype_name(value.dtype), tuple(info.shape), layout,
                                    param=info.name, state=key))
            pending.append((name, value[: info.end - info.start], info.start))
        if info.scalar_state:
            scalar_state[info.name] = {k: scalar_json(v, f"optimizer state {k!r} of {info.name!r}")
                                       for k, v in info.scalar_state.items()}
    for buf in state.buffers:
        specs.append(TensorSpec(buf.name, "buffer", dtype_name(buf.dtype), tuple(buf.tensor.shape), "whole"))
        if state.rank == 0:
            pending.append((buf.name, buf.tensor.to(buf.dtype), 0))
    for rank, size in enumerate(rank_state_sizes):
        if size:  # ranks without per-rank Stateful objects store nothing
            specs.append(TensorSpec(rank_state_key(rank), "extra", "U8", (size,), "local", owner=rank))

    flat = [(name, tensor.detach().reshape(-1), start) for name, tensor, start in pending]
    copies = snapshot.take([t for _, t, _ in flat]) if snapshot is not None else [_on_host(t) for _, t, _ in flat]
    for (name, _, start), tensor in zip(flat, copies):
        held[name] = Held(tensor, start)
    if rank_state:
        held[rank_state_key(state.rank)] = Held(torch.frombuffer(bytearray(rank_state), dtype=torch.uint8), 0)
    return RankContents(specs, held, _manifest_fields(state, scalar_state) if state.rank == 0 else {})


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")


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
