"""Reading and writing the engine's state: per-parameter shards, full weights, counters.

Shards are what a checkpoint stores (each rank exactly its `shard_range`, see ShardInfo);
full state dicts are for tests, exports and starting from pretrained weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
import torch.distributed as dist

from zeroshard.engine.collectives import gather_into_params
from zeroshard.engine.layout import ShardInfo, rows_to_flat, set_fragment
from zeroshard.engine.optim import group_names

if TYPE_CHECKING:
    from zeroshard.engine.engine import ZeroEngine


def named_shards(engine: "ZeroEngine") -> Iterator[tuple[str, ShardInfo]]:
    for s in engine.shards:
        yield s.name, ShardInfo(
            name=s.name, shape=tuple(s.shape), dtype=s.dtype, start=s.start, end=s.end, chunk=s.chunk,
            world_size=engine.shard_world_size, requires_grad=s.requires_grad, master=s.master,
            optimizer_state=engine.optimizer.state.get(s.master, {}) if s.requires_grad else {})


def load_shards(engine: "ZeroEngine", states: Mapping[str, Mapping[str, Any]], strict: bool = True,
                adopt: bool = False) -> None:
    """Assign `{"fragment": tensor, "optimizer_state": {...}}` per parameter name.

    adopt=True lets per-element optimizer state tensors that already have the padded layout
    (contiguous, `chunk` elements, fp32 or their own integer dtype, on the engine's device)
    become the optimizer's state as they are, without a copy: the checkpoint loader reads
    straight into such tensors. The caller must not reuse them.

    A fragment (and each per-element state tensor) holds this rank's `end - start` real elements,
    or the padded `chunk`. Either key may be left out. Every rank must call this (stages 1 and 2
    re-gather the module parameters afterwards).
    """
    by_name = {s.name: s for s in engine.shards}
    unknown = sorted(set(states) - set(by_name))
    missing = sorted(set(by_name) - set(states))
    if unknown or (strict and missing):
        raise KeyError(f"load_shards: unknown parameters {unknown}, missing parameters {missing}")
    engine.wait_params()  # no in-flight gather may land after the values loaded here
    with torch.no_grad():
        for name, st in states.items():
            s = by_name[name]
            if st.get("fragment") is not None:
                set_fragment(s.master, st["fragment"].to(s.master.device, torch.float32), s.owned)
            opt = st.get("optimizer_state")
            if opt:
                if not s.requires_grad:
                    raise ValueError(f"load_shards: {name!r} is frozen but optimizer state was given")
                engine.optimizer.state[s.master] = {k: _pad_state(v, s.master, s.owned, adopt) for k, v in opt.items()}
    _masters_to_params(engine, [by_name[n] for n in states])


def _pad_state(value: Any, master: torch.Tensor, owned: int, adopt: bool = False) -> Any:
    if not (torch.is_tensor(value) and value.dim() >= 1):
        return value.clone() if torch.is_tensor(value) else value
    dtype = torch.float32 if value.is_floating_point() else value.dtype
    if (adopt and value.dim() == 1 and value.numel() == master.numel() and value.dtype == dtype
            and value.device == master.device and value.is_contiguous()):
        return value
    out = torch.zeros(master.numel(), dtype=dtype, device=master.device)
    set_fragment(out, value.to(master.device, dtype), owned)
    return out


def _masters_to_params(engine: "ZeroEngine", shards: list) -> None:
    if engine.stage == 3:
        return  # the next gather reads the masters
    if engine.stage == 0:
        with torch.no_grad():
            for s in shards:
                if s.master.data_ptr() != s.param.data.data_ptr():
                    s.param.data.copy_(s.master.view(s.shape))
        return
    gather_into_params(engine.shards, engine.compute_dtype, engine.world_size, engine._ag_group,
                       int(engine.config.zero_optimization.allgather_bucket_size), engine.device)


def full_state_dict(engine: "ZeroEngine") -> dict[str, Any]:
    """Gather each parameter to rank 0 in turn (one tensor in flight); others return {}."""
    refs = engine.module.state_dict(keep_vars=True)
    root = engine.rank == 0
    out: dict[str, Any] = {}
    done: dict[int, torch.Tensor | None] = {}
    with torch.no_grad():
        for key, value in refs.items():
            s = engine._shard_by_param.get(id(value))
            if s is not None:
                if s.index not in done:  # tied parameters: gathered once (on every rank)
                    done[s.index] = _gather_full(engine, s)
                if root:
                    out[key] = done[s.index]
            elif root:
                if torch.is_tensor(value):
                    dtype = engine._buffer_dtypes.get(key, value.dtype)
                    out[key] = value.detach().to("cpu", dtype).clone()
                else:
                    out[key] = value  # extra state, passed through
    return out


def _gather_full(engine: "ZeroEngine", s: Any) -> torch.Tensor | None:
    if engine.shard_world_size == 1:
        return s.master[: s.numel].detach().to("cpu").clone().view(s.shape)
    root = engine.rank == 0
    mine = s.master.detach().to(engine.device)  # offloaded masters: the collective runs on the device
    parts = [torch.empty_like(mine) for _ in range(engine.world_size)] if root else None
    dist.gather(mine, parts, dst=0, group=engine.group)
    if not root:
        return None
    full = torch.empty(s.numel, dtype=torch.float32)
    if s.chunk:
        rows_to_flat(torch.stack(parts).cpu(), full)
    return full.view(s.shape)


def load_full_state_dict(engine: "ZeroEngine", state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Every rank passes the full state dict; each keeps its own range. No communication."""
    refs = engine.module.state_dict(keep_vars=True)
    missing = [k for k in refs if k not in state_dict]
    unexpected = [k for k in state_dict if k not in refs]
    if strict and (missing or unexpected):
        raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    engine.wait_params()
    with torch.no_grad():
        for key, ref in refs.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            s = engine._shard_by_param.get(id(ref))
            if s is not None:
                if tuple(value.shape) != tuple(s.shape):
                    raise ValueError(f"{key}: shape {tuple(value.shape)} != model's {tuple(s.shape)}")
                flat = value.detach().reshape(-1)[s.start: s.end]
                set_fragment(s.master, flat.to(s.master.device, torch.float32), s.owned)
                if engine.stage < 3 and s.master.data_ptr() != s.param.data.data_ptr():
                    s.param.data.copy_(value.detach().view(s.shape).to(s.param.device, s.param.dtype))
            elif torch.is_tensor(ref):
                ref.data.copy_(value.detach().to(ref.device, ref.dtype))


def engine_state(engine: "ZeroEngine") -> dict[str, Any]:
    names = group_names(engine.optimizer, engine.shards)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": n}
              for g, n in zip(engine.optimizer.param_groups, names)]
    return {
        "zero_stage": engine.stage, "world_size": engine.world_size,
        "shard_world_size": engine.shard_world_size,
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps, "loss_scaler": engine.scaler.state_dict(),
        "optimizer_class": type(engine.optimizer).__name__, "param_groups": groups,
    }


def load_engine_state(engine: "ZeroEngine", st: Mapping[str, Any]) -> None:
    groups = engine.optimizer.param_groups
    if len(st["param_groups"]) != len(groups):
        raise ValueError(f"saved state has {len(st['param_groups'])} param groups, the optimizer {len(groups)}")
    for g, saved, names in zip(groups, st["param_groups"], group_names(engine.optimizer, engine.shards)):
        if list(saved["params"]) != names:
            raise ValueError(f"param group members differ: saved {saved['params']} vs {names}")
        g.update({k: v for k, v in saved.items() if k != "params"})
    engine.global_steps = int(st["global_steps"])
    engine.micro_steps = int(st["micro_steps"])
    engine.skipped_steps = int(st.get("skipped_steps", 0))
    engine.scaler.load_state_dict(st["loss_scaler"])
