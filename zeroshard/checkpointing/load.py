"""Loading into an engine, at any world size and stage, whatever the checkpoint was saved with.

Each rank reads only the element ranges it now owns (ranged reads, through
zeroshard.partition), so no rank reads the whole checkpoint and stage 3 never builds the full
model anywhere. When the world size matches, those ranges are exactly the rank's own file (plus
buffers, stored once in rank 0's file). Names and shapes are checked before anything is read;
read errors are agreed on by all ranks (zeroshard.agree) before anything is restored, so a bad
checkpoint raises everywhere instead of hanging a collective. What was read becomes an
EngineState that `engine.restore()` applies; Stateful objects get theirs after it.

Speed: the engine's masters and optimizer state are read into *in place* (no allocation, no
copy: a load runs at the speed of the reads and the hashes); on a CUDA device through two
reused pinned windows (checkpointing/staging.py), each copy to the device overlapping the next
read. The price: a read that fails half-way (a hash mismatch found at the end of a fragment, an
I/O error) leaves those tensors partly overwritten. The error says so on every rank; load a
good checkpoint before training on. Everything that can be checked before reading (manifest,
names, shapes, every needed file's header and size) is checked first.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch

from zeroshard.agree import agree
from zeroshard.checkpointing.load_names import LoadNames, check_names, match_names, model_shapes
from zeroshard.checkpointing.optimizer_keys import check_saved_keys, saved_keys
from zeroshard.checkpointing.staging import Staging
from zeroshard.checkpointing.stateful import one_line, parse_rank_state, restoring, scope_of
from zeroshard.engine.contract import Counters, EngineState, ParamGroup
from zeroshard.errors import CheckpointError, InvalidArgumentError, StorageError, ZeroshardError
from zeroshard.format import CheckpointReader, open_checkpoint
from zeroshard.format.full_model import SourceTensor, read_source_tensor, stripped_names
from zeroshard.format.manifest import MANIFEST_NAME, Manifest, TensorEntry
from zeroshard.format.reader import fragments_of
from zeroshard.format.training_state import (
    ENGINE_COUNTERS,
    global_stateful,
    global_stateful_keys,
    legacy_rng_key,
    rank_state_key,
)
from zeroshard.interop.pickled_model import open_model
from zeroshard.storage.safetensors_header import torch_dtype

if TYPE_CHECKING:
    from zeroshard.engine import ZeroEngine

ACTION = "the checkpoint load"


UNRESTORED = "is not restored: nothing was given to load it into"


def load_checkpoint(engine: "ZeroEngine", group: Any, path: str, *, strict: bool = True,
                    load_optimizer_states: bool = True, stateful: Mapping[str, Any] | None = None,
                    storage_options: dict | None = None, load_module_only: bool = False) -> Any:
    """Load a zeroshard checkpoint into `engine` and the `stateful` objects (by key); returns
    the saved client_state. Collective on `group`. An engine without an optimizer (inference)
    takes the weights, buffers and counters only. load_module_only: the weights and buffers only
    (a warm start, DeepSpeed's flag): the step counters, loss scale and `stateful` objects stay."""
    load_optimizer_states = load_optimizer_states and engine.optimizer is not None and not load_module_only
    if load_module_only:
        stateful = {}
    target = engine.checkpoint_state()
    loaded: EngineState | None = None
    rank_states: dict[str, Any] = {}
    manifest: Manifest | None = None
    error = None
    reading = False
    where = path
    try:
        location, manifest = open_checkpoint(path, storage_options)
        where = location.url
        names = match_names(target, manifest.tensors, where, strict, warn=target.rank == 0)
        fields = training_fields(target, manifest, location.url_of(MANIFEST_NAME), load_optimizer_states)
        if load_module_only:
            fields = dataclasses.replace(fields, counters=None, loss_scaler=None)
        if load_optimizer_states:  # a strict=False load too: the first step would fail all the same
            check_saved_keys(engine.optimizer, target.device, saved_keys(manifest.tensors.values()),
                             (manifest.optimizer or {}).get("class", ""), where, warn=target.rank == 0)
        if load_optimizer_states and strict and fields.param_groups is None and target.rank == 0:
            _warn_groups_differ(target, manifest, where)
        same_world = manifest.world_size == target.world_size
        # checked before reading, like every manifest field
        legacy_rng = legacy_rng_json(manifest, target.rank, location.url_of(MANIFEST_NAME)) if same_world else {}
        # at another world size this rank reads parts of saved fragments: hash the rest too
        with CheckpointReader(location, manifest, complete_fragments=True,
                              hash_behind=spare_core(target.world_size)) as reader:
            open_needed_files(reader, manifest, target, names)
            reading = True
            loaded = read_engine_state(fields, manifest, reader, names, load_optimizer_states=load_optimizer_states)
            if same_world and stateful:
                rank_states = read_rank_states(manifest, reader, target.rank, legacy_rng)
    except Exception as exc:  # whatever it is, every rank hears of it (nobody hangs in a collective)
        error = _load_error(exc, where, overwritten=reading)
    agree(error, group, action=ACTION)
    assert loaded is not None and manifest is not None
    error = None
    try:  # a failure on one rank is agreed on too: its peers must not wait in a later collective
        engine.restore(loaded, strict=False, adopt=True)
        skipped = [k for k, o in (stateful or {}).items() if scope_of(o) == "rank" and k != "rng"]
        if skipped and manifest.world_size != target.world_size and target.rank == 0:
            # RNG streams are expected to restart at another world size; a data position is not
            warnings.warn(f"{location.url}: saved at world size {manifest.world_size}, loaded at "
                          f"{target.world_size}: per-rank state of {', '.join(map(repr, skipped))} not restored",
                          stacklevel=3)
        unclaimed = [k for k in global_stateful_keys(manifest.extra) if k not in (stateful or {})]
        if unclaimed and load_optimizer_states and target.rank == 0:  # a resume whose schedule would restart
            warnings.warn(f"{location.url}: saved state of {', '.join(map(repr, unclaimed))} {UNRESTORED} (pass "
                          "lr_scheduler=... or the object under that key in stateful=...)", stacklevel=3)
        for key, obj in (stateful or {}).items():
            per_rank = scope_of(obj) == "rank"
            saved = rank_states.get(key) if per_rank else global_stateful(manifest.extra, key)
            if saved is not None:
                try:
                    obj.load_state_dict(saved)
                except Exception as exc:
                    # the file its state came from: this rank's (per-rank state) or the manifest
                    source = manifest.file_for_rank(target.rank).name if per_rank else MANIFEST_NAME
                    raise CheckpointError(location.url_of(source), restoring(key, obj, target.rank, exc)) from None
    except Exception as exc:
        error = exc if isinstance(exc, ZeroshardError) else CheckpointError(
            location.url, f"rank {target.rank}: restoring the engine failed: {one_line(exc)}; its state may now be "
                          "partly overwritten: load a good checkpoint before training on")
    agree(error, group, action=ACTION)
    return manifest.client_state


def _load_error(exc: Exception, where: str, overwritten: bool) -> ZeroshardError:
    """A load failure as one error every rank can hear: zeroshard's own as it is, anything else
    named by `where`; after reading began, it also says the engine is now partly overwritten."""
    if isinstance(exc, ZeroshardError) and not overwritten:
        return exc
    if isinstance(exc, (CheckpointError, StorageError)):
        where, problem = exc.where, exc.problem
    else:
        problem = str(exc) if isinstance(exc, ZeroshardError) else one_line(exc)
    if overwritten:
        problem += "; this rank's engine state is now partly overwritten: load a good checkpoint before training on"
    return CheckpointError(where, problem)


def spare_core(world_size: int) -> bool:
    """Whether a rank has a core to hash on while it reads (CheckpointReader's hash_behind):
    more usable cores than ranks on this node (LOCAL_WORLD_SIZE, as torchrun sets it; else the
    whole world, as if every rank were here)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or world_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores > ranks_here


def open_needed_files(reader: CheckpointReader, manifest: Manifest, target: EngineState, names: LoadNames) -> None:
    """Open (and check the header and size of) every file holding this rank's ranges, before a
    byte is read into the engine: its parameters' ranges, and every buffer whole (rank 0's file,
    or all that hold a buffer saved as a parameter)."""
    infos = {info.name: info for info in target.params}
    ranks = {rank for name in names.params for rank, _, _ in
             fragments_of(manifest.tensors[name], manifest.world_size, infos[name].start, infos[name].end)}
    ranks |= {rank for name in names.buffers
              for rank, _, _ in fragments_of(manifest.tensors[name], manifest.world_size)}
    for rank in sorted(ranks):
        reader.open_file(rank)


def read_engine_state(target: EngineState, manifest: Manifest, reader: CheckpointReader, names: LoadNames, *,
                      load_optimizer_states: bool) -> EngineState:
    """This rank's ranges of the parameters in `names` of `target`, its buffers in `names` (and
    the counters, param groups) read from the checkpoint, as an EngineState for `restore`."""
    infos = {info.name: info for info in target.params}
    optimizer_entries: dict[str, list[TensorEntry]] = {}  # by parameter: one pass, not one per parameter
    for entry in manifest.tensors.values():
        if entry.role == "optimizer":
            optimizer_entries.setdefault(entry.param, []).append(entry)
    scalars = (manifest.optimizer or {}).get("scalar_state") or {}
    options = {name: group.options for group in target.param_groups or () for name in group.params}
    staging = Staging(target.device) if target.device.type == "cuda" else None
    params = []
    for name in names.params:
        info = infos[name]
        fragment = _read_master(reader, manifest.tensors[name], info, staging)
        opt: dict[str, Any] = {}
        if load_optimizer_states and info.requires_grad:
            opt = _optimizer_state(reader, optimizer_entries.get(name, []), scalars.get(name, {}), info,
                                   target.device, staging, options.get(name, {}))
        params.append(dataclasses.replace(info, master=fragment, optimizer_state=opt))
    reader.settle()  # every byte read into the engine is verified before it is used
    if staging is not None:
        staging.finish()
    own = {b.name: b for b in target.buffers}
    buffers = tuple(dataclasses.replace(b, tensor=reader.read_flat(manifest.tensors[b.name]).reshape(b.tensor.shape))
                    for b in (own[n] for n in names.buffers))
    return dataclasses.replace(target, params=tuple(params), buffers=buffers)


def training_fields(target: EngineState, manifest: Manifest, where: str, load_optimizer_states: bool) -> EngineState:
    """`target` with the counters, loss scaler and param groups the manifest's JSON holds (§9.2),
    checked for type before any tensor is read: a malformed field is one CheckpointError."""
    try:
        saved = manifest.extra.get("engine") or {}
        counters = loss_scaler = None
        if saved:
            counters = Counters(*(_count(saved.get(k, 0), k) for k in ENGINE_COUNTERS))
            scaler = saved.get("loss_scaler")
            if scaler is not None:
                loss_scaler = {"scale": float(scaler["scale"]),
                               "good_steps": _count(scaler["good_steps"], "good_steps"),
                               "hysteresis_left": _count(scaler["hysteresis_left"], "hysteresis_left")}
        groups = _param_groups(target, manifest) if load_optimizer_states else None
    except Exception as exc:
        problem = f"malformed training state in the manifest ({type(exc).__name__}: {exc})"
        raise CheckpointError(where, problem) from None
    return dataclasses.replace(target, counters=counters, loss_scaler=loss_scaler, param_groups=groups)


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{what} is {value!r}, not a count")
    return value


def _param_groups(target: EngineState, manifest: Manifest) -> tuple[ParamGroup, ...] | None:
    """Hyperparameters come back only when the groups hold the same parameters (a strict=False
    partial load keeps the optimizer's own)."""
    groups = (manifest.optimizer or {}).get("param_groups") or []
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params", []), list)
                                               for g in groups):
        raise InvalidArgumentError("optimizer.param_groups must be a list of objects with a `params` list")
    if [list(g.get("params") or []) for g in groups] != [list(g.params) for g in target.param_groups or ()]:
        return None
    return tuple(ParamGroup(tuple(g["params"]), {k: v for k, v in g.items() if k != "params"}) for g in groups)


def _warn_groups_differ(target: EngineState, manifest: Manifest, where: str) -> None:
    """The optimizer keeps its own hyperparameters when its groups hold other parameters than the
    saved ones (an HF Trainer import has two: no weight decay on biases and norms): say so, with
    the saved values it does not take, rather than train on with another lr or weight decay."""
    saved = (manifest.optimizer or {}).get("param_groups") or []
    if not saved or not target.param_groups:
        return

    def shown(members: list[str] | tuple[str, ...], options: Mapping[str, Any]) -> str:
        names = ", ".join(members[:3]) + (f", ... ({len(members)})" if len(members) > 3 else "")
        values = ", ".join(f"{k} {options[k]}" for k in ("lr", "weight_decay") if k in options)
        return f"[{names}]" + (f" {values}" if values else "")

    then = "; ".join(shown(g.get("params") or [], g) for g in saved)
    now = "; ".join(shown(g.params, g.options) for g in target.param_groups)
    warnings.warn(f"{where}: the optimizer's param groups ({len(target.param_groups)}: {now}) are not the saved ones "
                  f"({len(saved)}: {then}): it keeps its own hyperparameters; build it with the saved groups to resume "
                  "theirs", stacklevel=4)


def _scalar(entry: dict[str, Any], device: torch.device | str) -> Any:
    if "dtype" in entry:
        return torch.tensor(entry["value"], dtype=torch_dtype(entry["dtype"]), device=device)
    return entry["value"]


def _scalar_device(live: Any, master: torch.Tensor, options: Mapping[str, Any]) -> torch.device | str:
    """Where the optimizer keeps a scalar state tensor (Adam's `step`): where the live state has
    it; else where torch.optim puts it, on the parameter's device when the group is capturable or
    fused, in host memory otherwise. [Note: a `step` on a GPU in a plain Adam costs a device
    sync per parameter per step (its bias correction calls .item()).]"""
    if torch.is_tensor(live):
        return live.device
    return master.device if options.get("capturable") or options.get("fused") else "cpu"


def _in_place(live: Any, dtype: torch.dtype, chunk: int, staging: Staging | None) -> bool:
    """Whether a live engine tensor can be read into as it is: the padded layout, in host memory
    or (through `staging`'s pinned windows) on the engine's device."""
    return (torch.is_tensor(live) and live.dtype == dtype and live.dim() == 1 and live.numel() == chunk
            and live.is_contiguous()
            and (live.device.type == "cpu" or (staging is not None and live.device.type == staging.device.type)))


def _read(reader: CheckpointReader, entry: TensorEntry, start: int, out: torch.Tensor,
          staging: Staging | None) -> None:
    """Elements [start, start + out.numel()) of `entry` into the 1-D tensor `out`."""
    if out.device.type == "cpu":
        reader.read_into(entry, start, memoryview(out.view(torch.uint8).numpy()))
    else:
        assert staging is not None
        staging.read(reader, entry, start, out)


def _read_master(reader: CheckpointReader, entry: TensorEntry, info: Any, staging: Staging | None) -> torch.Tensor:
    """Masters are read straight into the engine's own tensor (restore() then copies nothing):
    on the host directly, on a CUDA device through pinned windows; others through a host tensor."""
    if entry.dtype == "F32" and _in_place(info.master, torch.float32, info.chunk, staging):
        owned = info.end - info.start
        if owned:
            _read(reader, entry, info.start, info.master[:owned], staging)
        return info.master
    return reader.read_flat(entry, info.start, info.end)


def _optimizer_state(reader: CheckpointReader, entries: list[TensorEntry], scalars: dict[str, Any], info: Any,
                     device: torch.device, staging: Staging | None,
                     options: Mapping[str, Any]) -> dict[str, Any]:
    """Per-element state is read straight into tensors of the engine's padded layout (`chunk`
    elements, zero padding): the engine's own where it has them (a resumed or reloaded
    engine), else new ones (on the device when `staging` can fill them there), which
    restore(adopt=True) takes over without another copy."""
    state: dict[str, Any] = {}
    owned = info.end - info.start
    for entry in entries:
        dtype = torch_dtype(entry.dtype)
        live = info.optimizer_state.get(entry.state)
        if _in_place(live, dtype, info.chunk, staging):
            padded = live
        else:
            padded = torch.empty(info.chunk, dtype=dtype, device=device if staging is not None else "cpu")
        padded[owned:].zero_()
        if owned:
            _read(reader, entry, info.start, padded[:owned], staging)
        state[entry.state] = padded if padded.device == device else padded.to(device)
    for key, value in scalars.items():
        state[key] = _scalar(value, _scalar_device(info.optimizer_state.get(key), info.master, options))
    return state


def read_rank_states(manifest: Manifest, reader: CheckpointReader, rank: int,
                     legacy_rng: dict[str, Any]) -> dict[str, Any]:
    """Rank `rank`'s per-rank Stateful states by key (same world size only). `legacy_rng`:
    legacy_rng_json's result, for checkpoints without rank-state blobs."""
    entry = manifest.tensors.get(rank_state_key(rank))
    if entry is not None:
        blob = reader.read_flat(entry).numpy().tobytes()
        try:
            return parse_rank_state(blob)
        except ValueError as exc:  # its hashes held: it was written so (or forged with fresh hashes)
            raise CheckpointError(reader.where(entry.owner),
                                  f"rank {rank}: tensor {entry.name!r} (this rank's Stateful states): {exc}") from None
    rng = dict(legacy_rng)
    for device, key in (("cpu", "torch"), ("cuda", "cuda")):
        tensor = manifest.tensors.get(legacy_rng_key(rank, device))
        if tensor is not None:
            rng[key] = reader.read_flat(tensor)
    return {"rng": rng} if rng else {}


def legacy_rng_json(manifest: Manifest, rank: int, where: str) -> dict[str, Any]:
    """Checkpoints from before rank-state blobs kept Python's and NumPy's RNG states per rank in
    extra.rng (their torch states are `rng/rank-NNNNN/{cpu,cuda}` tensors)."""
    saved = (manifest.extra.get("rng") or {}).get(str(rank))
    if not saved:
        return {}
    try:
        version, internal, gauss = saved["python"]
        kind, keys, pos, has_gauss, cached = saved["numpy"]
        return {"python": {"version": _count(version, "version"),
                           "state": torch.tensor([_count(v, "state") for v in internal], dtype=torch.int64),
                           "gauss": None if gauss is None else float(gauss)},
                "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.array(keys, dtype=np.int64)),
                          "pos": _count(pos, "pos"), "has_gauss": _count(has_gauss, "has_gauss"),
                          "cached_gaussian": float(cached)}}
    except Exception as exc:
        raise CheckpointError(where, f"malformed extra.rng of rank {rank} ({type(exc).__name__}: {exc})") from None


def load_pretrained(engine: "ZeroEngine", group: Any, path: str, *, strict: bool = True,
                    storage_options: dict | None = None, strip_prefix: str | list[str] | None = None) -> None:
    """Load model weights from a full model (one .safetensors file or an HF folder with an
    index, or their torch.save counterparts) into a fresh engine: each rank reads only its
    ranges; optimizer state untouched. strip_prefix: removed from the file's tensor names that
    start with it (DDP's "module.", torch.compile's "_orig_mod.")."""
    target = engine.checkpoint_state()
    infos = {info.name: info for info in target.params}
    own_buffers = {b.name: b for b in target.buffers}
    params, buffers = [], []
    error = None
    readers: dict[str, Any] = {}
    try:
        folder, tensors, notes = open_model(path, storage_options)
        for note in notes if target.rank == 0 else []:
            warnings.warn(f"load_pretrained: {note}", stacklevel=3)
        renamed = stripped_names(path, [t.name for t in tensors], strip_prefix, option="strip_prefix")
        by_name: dict[str, SourceTensor] = dict(zip(renamed, tensors))
        # a full model does not say which tensors are buffers: names decide, as in torch's load_state_dict
        saved = {n: tuple(t.shape) for n, t in by_name.items() if n not in target.aliases}
        names = check_names(model_shapes(target), saved, path, strict, warn=target.rank == 0)
        for name in names:
            source = by_name[name]
            if name in infos:
                info = infos[name]
                fragment = _read_source(folder, readers, source, info.start, info.end)
                params.append(dataclasses.replace(info, master=fragment, optimizer_state={}))
            else:
                value = _read_source(folder, readers, source, 0, int(np.prod(source.shape))).reshape(source.shape)
                buffers.append(dataclasses.replace(own_buffers[name], tensor=value))
    except Exception as exc:  # whatever it is, every rank hears of it
        error = _load_error(exc, path, overwritten=False)
    finally:
        for reader in readers.values():
            reader.close()
    agree(error, group, action="loading pretrained weights")
    engine.restore(dataclasses.replace(target, params=tuple(params), buffers=tuple(buffers), counters=None,
                                       loss_scaler=None, param_groups=None), strict=False)


def _read_source(folder: Any, readers: dict[str, Any], source: SourceTensor, start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of a full-model tensor, read straight into a new 1-D tensor."""
    if source.file not in readers:
        readers[source.file] = folder.open_reader(source.file, follow_links=True)
    return read_source_tensor(readers[source.file], source, start, end)
