"""Loading into an engine, at any world size and stage, whatever the checkpoint was saved with.

Each rank reads only the element ranges it now owns (ranged reads, through
zeroshard.partition.pieces), so no rank reads the whole checkpoint and stage 3 never builds the
full model anywhere. When the world size matches, those ranges are exactly the rank's own file
(plus buffers, stored once in rank 0's file). Names and shapes are checked before any state is
touched; read errors are agreed on by all ranks before anything is assigned, so a bad
checkpoint raises everywhere instead of hanging a collective.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from zeroshard.checkpointing.collect import rng_key
from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.format import CheckpointReader, open_checkpoint
from zeroshard.format.full_model import SourceTensor, open_full_model
from zeroshard.format.manifest import Manifest, TensorEntry
from zeroshard.storage.safetensors_header import torch_dtype

if TYPE_CHECKING:
    from zeroshard.engine import ZeroEngine


def _check_names(engine: "ZeroEngine", shapes: dict[str, tuple[int, ...]], where: str, strict: bool) -> list[str]:
    """The parameter names to load; raises listing missing, unexpected and mis-shaped names."""
    ours = {name: tuple(info.shape) for name, info in engine.named_shards()}
    missing = sorted(set(ours) - set(shapes))
    unexpected = sorted(set(shapes) - set(ours))
    mismatched = sorted(f"{n} (checkpoint {list(shapes[n])}, model {list(ours[n])})"
                        for n in set(ours) & set(shapes) if shapes[n] != ours[n])
    problems = []
    if mismatched:
        problems.append(f"shape mismatch: {', '.join(mismatched)}")
    if strict and missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing)}")
    if strict and unexpected:
        problems.append(f"not in the model: {', '.join(unexpected)}")
    if problems:
        hint = "" if mismatched else " (load with strict=False to skip them)"
        raise CheckpointError(where, "; ".join(problems) + hint)
    return [n for n in ours if n in shapes]


def _agree(engine: "ZeroEngine", group: Any, error: BaseException | None) -> None:
    """Raise on every rank if any rank failed (collective)."""
    errors: list[Any] = [None] * engine.world_size
    dist.all_gather_object(errors, None if error is None else str(error), group=group)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if error is not None:
        raise error
    if failed:
        raise ZeroshardError("load failed on other ranks, nothing was loaded: " + "; ".join(failed))


def _scalar(entry: dict[str, Any], device: torch.device) -> Any:
    if "dtype" in entry:
        return torch.tensor(entry["value"], dtype=torch_dtype(entry["dtype"]), device=device)
    return entry["value"]


def _restore_types(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """JSON turned tuples (Adam's betas) into lists: give them back their type."""
    return {k: tuple(v) if isinstance(current.get(k), tuple) and isinstance(v, list) else v for k, v in saved.items()}


def load_checkpoint(engine: "ZeroEngine", group: Any, path: str, *, strict: bool = True,
                    load_optimizer_states: bool = True, lr_scheduler: Any = None,
                    storage_options: dict | None = None) -> Any:
    """Load a zeroshard checkpoint into `engine`; returns the saved client_state."""
    location, manifest = open_checkpoint(path, storage_options)
    where = location.url
    params = {n: t.shape for n, t in manifest.tensors.items() if t.role == "param"}
    names = _check_names(engine, params, where, strict)
    shards = dict(engine.named_shards())
    states: dict[str, dict[str, Any]] = {}
    buffers: dict[str, torch.Tensor] = {}
    error = None
    optimizer_entries: dict[str, list[TensorEntry]] = {}  # by parameter: one pass, not one per parameter
    for entry in manifest.tensors.values():
        if entry.role == "optimizer":
            optimizer_entries.setdefault(entry.param, []).append(entry)
    try:
        with CheckpointReader(location, manifest) as reader:
            for name in names:
                info = shards[name]
                state: dict[str, Any] = {"fragment": reader.read_flat(manifest.tensors[name], info.start, info.end)}
                if load_optimizer_states and info.requires_grad:
                    state["optimizer_state"] = _optimizer_state(reader, manifest, optimizer_entries.get(name, []),
                                                                name, info, engine.device)
                states[name] = state
            own = dict(engine.module.named_buffers())
            for name, entry in manifest.tensors.items():
                if entry.role == "buffer" and name in own:
                    buffers[name] = reader.read_flat(entry).reshape(entry.shape)
            rng = _read_rng(engine, manifest, reader)
    except (ZeroshardError, OSError, ValueError) as exc:
        error = exc
    _agree(engine, group, error)

    engine.load_shards(states, strict=False, adopt=True)
    _assign_buffers(engine, buffers)
    _load_engine_state(engine, manifest, load_optimizer_states)
    if lr_scheduler is not None and manifest.extra.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(manifest.extra["lr_scheduler"])
    _set_rng(engine, manifest, rng)
    return manifest.client_state


def _optimizer_state(reader: CheckpointReader, manifest: Manifest, entries: list[TensorEntry], name: str, info: Any,
                     device: torch.device) -> dict[str, Any]:
    """Per-element state is read straight into tensors of the engine's padded layout (`chunk`
    elements, zero padding), which load_shards(adopt=True) takes over without another copy."""
    state: dict[str, Any] = {}
    owned = info.end - info.start
    for entry in entries:
        padded = torch.empty(info.chunk, dtype=torch_dtype(entry.dtype), device="cpu")
        padded[owned:].zero_()
        if owned:
            reader.read_into(entry, info.start, memoryview(padded[:owned].view(torch.uint8).numpy()))
        state[entry.state] = padded.to(device) if device.type != "cpu" else padded
    scalars = ((manifest.optimizer or {}).get("scalar_state") or {}).get(name, {})
    for key, value in scalars.items():
        state[key] = _scalar(value, device)
    return state


def _load_engine_state(engine: "ZeroEngine", manifest: Manifest, with_optimizer: bool) -> None:
    """Counters, loss scaler and param-group hyperparameters. Hyperparameters come back only
    when the groups hold the same parameters (a strict=False partial load keeps the
    optimizer's own)."""
    saved = dict(manifest.extra.get("engine") or {})
    if not saved:
        return
    current = engine.engine_state()["param_groups"]
    groups = (manifest.optimizer or {}).get("param_groups") or []
    same_members = [g.get("params") for g in groups] == [g["params"] for g in current]
    if with_optimizer and same_members:
        saved["param_groups"] = [_restore_types(g, c) for g, c in zip(groups, engine.optimizer.param_groups)]
    else:
        saved["param_groups"] = current
    engine.load_engine_state(saved)


def _read_rng(engine: "ZeroEngine", manifest: Manifest, reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """This rank's torch RNG states; only at the same world size (they are per rank)."""
    if manifest.world_size != engine.world_size:
        return {}
    devices = ["cpu"] + (["cuda"] if engine.device.type == "cuda" else [])
    entries = {d: manifest.tensors.get(rng_key(engine.rank, d)) for d in devices}
    return {d: reader.read_flat(e) for d, e in entries.items() if e is not None}


def _set_rng(engine: "ZeroEngine", manifest: Manifest, rng: dict[str, torch.Tensor]) -> None:
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], engine.device)
    saved = (manifest.extra.get("rng") or {}).get(str(engine.rank)) if manifest.world_size == engine.world_size else None
    if saved:
        version, internal, gauss = saved["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, pos, has_gauss, cached = saved["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def load_pretrained(engine: "ZeroEngine", group: Any, path: str, *, strict: bool = True,
                    storage_options: dict | None = None) -> None:
    """Load model weights from a full model (one .safetensors file or an HF folder with an
    index) into a fresh engine: each rank reads only its ranges; optimizer state untouched."""
    folder, tensors = open_full_model(path, storage_options)
    by_name: dict[str, SourceTensor] = {t.name: t for t in tensors}
    shards = dict(engine.named_shards())
    not_params = set(dict(engine.module.named_buffers())) | {
        key for key, value in engine.module.state_dict(keep_vars=True).items()
        if id(value) in engine._shard_by_param and engine._shard_by_param[id(value)].name != key}  # tied aliases
    names = _check_names(engine, {n: t.shape for n, t in by_name.items() if n not in not_params}, path, strict)
    states: dict[str, dict[str, Any]] = {}
    buffers: dict[str, torch.Tensor] = {}
    error = None
    readers: dict[str, Any] = {}
    try:
        for name in names:
            info, source = shards[name], by_name[name]
            states[name] = {"fragment": _read_source(folder, readers, source, info.start, info.end)}
        for name in dict(engine.module.named_buffers()):
            if name in by_name:
                source = by_name[name]
                buffers[name] = _read_source(folder, readers, source, 0, int(np.prod(source.shape))).reshape(source.shape)
    except (ZeroshardError, OSError, ValueError) as exc:
        error = exc
    finally:
        for reader in readers.values():
            reader.close()
    _agree(engine, group, error)
    engine.load_shards(states, strict=False)
    _assign_buffers(engine, buffers)


def _assign_buffers(engine: "ZeroEngine", buffers: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        own = dict(engine.module.named_buffers())
        for name, value in buffers.items():
            own[name].copy_(value.to(own[name].device, own[name].dtype))


def _read_source(folder: Any, readers: dict[str, Any], source: SourceTensor, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of a full-model tensor, read straight into a new 1-D tensor."""
    if source.file not in readers:
        readers[source.file] = folder.open_reader(source.file, follow_links=True)
    out = torch.empty(end - start, dtype=torch_dtype(source.dtype))
    if end > start:
        readers[source.file].read_into(source.begin + start * source.itemsize, memoryview(out.view(torch.uint8).numpy()))
    return out
