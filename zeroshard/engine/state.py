"""Reading and writing the engine's state: the checkpoint contract (checkpoint_state/restore,
see contract.py), per-parameter shards, full weights.

Shards are what a checkpoint stores (each rank exactly its `shard_range`, see ShardInfo);
full state dicts are for tests, exports and starting from pretrained weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch
import torch.distributed as dist

from zeroshard.engine.collectives import gather_into_params
from zeroshard.engine.contract import BufferState, Counters, EngineState, ParamGroup
from zeroshard.engine.layout import ShardInfo, rows_to_flat, set_fragment
from zeroshard.engine.optim import group_names
from zeroshard.errors import InvalidArgumentError, MissingKeyError

if TYPE_CHECKING:
    from zeroshard.engine.engine_view import EngineView


def named_shards(engine: "EngineView") -> Iterator[tuple[str, ShardInfo]]:
    for s in engine.shards:
        yield s.name, ShardInfo(
            name=s.name, shape=tuple(s.shape), dtype=s.dtype, start=s.start, end=s.end, chunk=s.chunk,
            world_size=engine.shard_world_size, requires_grad=s.requires_grad, master=s.master,
            optimizer_state=engine.optimizer.state.get(s.master, {})
            if s.requires_grad and engine.optimizer is not None else {})


def load_shards(engine: "EngineView", states: Mapping[str, Mapping[str, Any]], strict: bool = True,
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
        raise MissingKeyError(f"load_shards: unknown parameters {unknown}, missing parameters {missing}")
    engine.wait_params()  # no in-flight gather may land after the values loaded here
    with torch.no_grad():
        for name, st in states.items():
            s = by_name[name]
            fragment = st.get("fragment")
            if fragment is not None and fragment.data_ptr() != s.master.data_ptr():  # else: read in place
                set_fragment(s.master, fragment.to(s.master.device, s.master.dtype), s.owned)
            opt = st.get("optimizer_state")
            if opt:
                if not s.requires_grad or engine.optimizer is None:
                    raise InvalidArgumentError(f"load_shards: optimizer state was given for {name!r}, which "
                                               f"{'has no optimizer' if s.requires_grad else 'is frozen'}")
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


def _masters_to_params(engine: "EngineView", shards: list) -> None:
    if engine.stage == 3:
        engine.param_tier.update()  # the next gather reads the masters, or (offload_param) their copy
        return
    if engine.stage == 0:
        with torch.no_grad():
            for s in shards:
                if s.master.data_ptr() != s.param.data.data_ptr():
                    s.param.data.copy_(s.master.view(s.shape))
        return
    gather_into_params(engine.shards, engine.compute_dtype, engine.world_size, engine.param_gather_group,
                       int(engine.config.zero_optimization.allgather_bucket_size), engine.device)


def full_state_dict(engine: "EngineView") -> dict[str, Any]:
    """Gather each parameter to rank 0 in turn (one tensor in flight); others return {}."""
    out = {}
    for key, value in full_state_items(engine):  # every rank iterates: the gathers are collective
        if engine.rank == 0:
            out[key] = value
    return out


def module_entries(module: torch.nn.Module) -> dict[str, Any]:
    """module.state_dict(keep_vars=True) without the modules' state-dict hooks: parameters,
    persistent buffers and extra state, named as the modules hold them. A hook may rename or
    recompute entries (torchtitan's fused-QKV attention splits its wqkv parameter into new
    wq/wk/wv tensors, reading a stage-3 parameter's released storage); the engine holds the
    parameters themselves, so its checkpoints name them as named_parameters() does."""
    out: dict[str, Any] = {}

    def walk(m: torch.nn.Module, prefix: str) -> None:
        m._save_to_state_dict(out, prefix, True)  # what state_dict() runs for each module, before its hooks
        for name, child in m._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")

    walk(module, "")
    return out


def full_state_items(engine: "EngineView") -> Iterator[tuple[str, Any]]:
    """(name, value) for each entry of model.state_dict() (module_entries: its hooks not run), in
    order: on rank 0 full CPU tensors
    (parameters fp32, buffers in their dtype before the engine's cast), elsewhere None.
    Collective: every rank iterates to the end. A gathered parameter is kept only until its
    last tied name, so memory holds one tensor (plus tied ones) whatever the model size."""
    engine.wait_params()  # stages 1-2: the module's buffers and names are read below
    refs = module_entries(engine.module)
    root = engine.rank == 0
    uses: dict[int, int] = {}
    for value in refs.values():
        s = engine.shard_of(value)
        if s is not None:
            uses[s.index] = uses.get(s.index, 0) + 1
    done: dict[int, torch.Tensor | None] = {}
    for key, value in refs.items():
        s = engine.shard_of(value)
        if s is not None:
            if s.index not in done:  # tied parameters: gathered once (on every rank)
                with torch.no_grad():
                    done[s.index] = _gather_full(engine, s)
            full = done[s.index]
            uses[s.index] -= 1
            if not uses[s.index]:
                del done[s.index]
            yield key, full
        elif not root:
            yield key, None
        elif torch.is_tensor(value):
            yield key, value.detach().to("cpu", engine.buffer_dtypes.get(key, value.dtype)).clone()
        else:
            yield key, value  # extra state, passed through


def _gather_full(engine: "EngineView", s: Any) -> torch.Tensor | None:
    if engine.shard_world_size == 1:
        return s.master[: s.numel].detach().to("cpu", torch.float32, copy=True).view(s.shape)
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


def load_full_state_dict(engine: "EngineView", state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Every rank passes the full state dict; each keeps its own range. No communication."""
    refs = module_entries(engine.module)
    missing = [k for k in refs if k not in state_dict]
    unexpected = [k for k in state_dict if k not in refs]
    if strict and (missing or unexpected):
        raise MissingKeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    engine.wait_params()
    with torch.no_grad():
        for key, ref in refs.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            s = engine.shard_of(ref)
            if s is not None:
                if tuple(value.shape) != tuple(s.shape):
                    raise InvalidArgumentError(f"{key}: shape {tuple(value.shape)} != model's {tuple(s.shape)}")
                flat = value.detach().reshape(-1)[s.start: s.end]
                set_fragment(s.master, flat.to(s.master.device, s.master.dtype), s.owned)
                if engine.stage < 3 and s.master.data_ptr() != s.param.data.data_ptr():
                    s.param.data.copy_(value.detach().view(s.shape).to(s.param.device, s.param.dtype))
            elif torch.is_tensor(ref):
                ref.data.copy_(value.detach().to(ref.device, ref.dtype))
    engine.param_tier.update()


def checkpoint_state(engine: "EngineView") -> EngineState:
    """Live references to everything a checkpoint holds of this rank (see contract.py)."""
    engine.wait_params()
    aliases: dict[str, str] = {}
    buffers: list[BufferState] = []
    for key, value in module_entries(engine.module).items():
        shard = engine.shard_of(value)
        if shard is not None:
            if shard.name != key:
                aliases[key] = shard.name
        elif torch.is_tensor(value):
            buffers.append(BufferState(key, value.detach(), engine.buffer_dtypes.get(key, value.dtype)))
    groups: tuple[ParamGroup, ...] = ()
    optimizer_class = ""  # an inference engine has none
    if engine.optimizer is not None:
        names = group_names(engine.optimizer, engine.shards)
        groups = tuple(ParamGroup(tuple(n), {k: v for k, v in g.items() if k != "params"})
                       for g, n in zip(engine.optimizer.param_groups, names))
        cls = type(engine.optimizer)
        optimizer_class = f"{cls.__module__}.{cls.__qualname__}"
    return EngineState(
        zero_stage=engine.stage, world_size=engine.world_size, rank=engine.rank,
        shard_world_size=engine.shard_world_size, device=engine.device, compute_dtype=engine.compute_dtype,
        optimizer_class=optimizer_class,
        params=tuple(info for _, info in named_shards(engine)), buffers=tuple(buffers), aliases=aliases,
        counters=Counters(engine.global_steps, engine.micro_steps, engine.skipped_steps),
        loss_scaler=engine.scaler.state_dict(), param_groups=groups)


def restore(engine: "EngineView", state: EngineState, strict: bool = True, adopt: bool = False) -> None:
    """Apply `state` (collective at stages 1-2: every rank calls it).

    Each ShardInfo must have this rank's range (start/end/chunk) of its parameter; its `master`
    holds `end - start` real elements or the padded `chunk`. Tensors that already are the
    engine's own (a loader read straight into them) are not copied again. adopt=True: per-element
    optimizer state already in the padded layout becomes the engine's without a copy (the
    caller gives those tensors up).
    """
    by_name = {s.name: s for s in engine.shards}
    for info in state.params:
        s = by_name.get(info.name)
        if s is not None and (info.start, info.end, info.chunk) != (s.start, s.end, s.chunk):
            raise InvalidArgumentError(f"restore: {info.name!r} holds elements [{info.start}, {info.end}) "
                                       f"of chunk {info.chunk}; this rank owns [{s.start}, {s.end}) of chunk {s.chunk}")
    load_shards(engine, {info.name: {"fragment": info.master, "optimizer_state": info.optimizer_state}
                         for info in state.params}, strict=strict, adopt=adopt)
    own = dict(engine.module.named_buffers())
    unknown = [b.name for b in state.buffers if b.name not in own]
    if unknown:
        raise MissingKeyError(f"restore: unknown buffers {unknown}")
    with torch.no_grad():
        for b in state.buffers:
            target = own[b.name]
            if b.tensor.data_ptr() != target.data_ptr():
                target.copy_(b.tensor.reshape(target.shape).to(target.device, target.dtype))
    if state.param_groups is not None and engine.optimizer is not None:
        _restore_param_groups(engine, state.param_groups)
    if state.counters is not None:
        engine.global_steps = int(state.counters.global_steps)
        engine.micro_steps = int(state.counters.micro_steps)
        engine.skipped_steps = int(state.counters.skipped_steps)
    if state.loss_scaler is not None:
        engine.scaler.load_state_dict(dict(state.loss_scaler))


def _restore_param_groups(engine: "EngineView", saved: tuple[ParamGroup, ...]) -> None:
    groups = engine.optimizer.param_groups
    if len(saved) != len(groups):
        raise InvalidArgumentError(f"saved state has {len(saved)} param groups, the optimizer {len(groups)}")
    for g, group, names in zip(groups, saved, group_names(engine.optimizer, engine.shards)):
        if list(group.params) != names:
            raise InvalidArgumentError(f"param group members differ: saved {list(group.params)} vs {names}")
        # JSON turned tuples (Adam's betas) into lists: give them back their type
        g.update({k: tuple(v) if isinstance(g.get(k), tuple) and isinstance(v, list) else v
                  for k, v in group.options.items() if k != "params"})
