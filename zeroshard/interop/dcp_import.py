"""Reading a DCP checkpoint (FSDP2's `dcp.save({"model": ..., "optim": ...})`) into an Imported,
in one process, without a process group.

`.metadata` (dcp_metadata.py) lists every tensor's chunks and where each chunk's bytes are
(`storage_data`: file, offset, length); with torch's default writer each chunk is a small
torch.save blob, read here with weights_only=True from exactly that byte range. Non-tensor
values (param-group hyperparameters) are torch.save'd objects, read the same way.
Names: `model.<fqn>` are weights and buffers; `optim.state.<fqn>.<key>` the optimizer state;
`optim.param_groups.<i>.<key>` the groups, whose `params` are FQNs (get_optimizer_state_dict's
layout). `planner_data` gives each flat key its path, so FQNs containing dots are unambiguous.
"""

from __future__ import annotations

import io
import os
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.format.training_state import scalar_json, to_json_value
from zeroshard.interop.dcp_metadata import load_metadata
from zeroshard.interop.imported import Imported, optimizer_class_of
from zeroshard.interop.torch_pickle import STAND_INS, open_inside


def _path_of(metadata: Any, key: str) -> tuple:
    planner = metadata.planner_data if isinstance(getattr(metadata, "planner_data", None), dict) else {}
    path = planner.get(key)
    if path:
        return tuple(path)
    head, _, rest = key.partition(".")
    return (head, rest)  # no planner data: model.<fqn> only


def _read_blob(folder: str, info: Any, what: str) -> Any:
    import torch

    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(os.path.join(folder, info.relative_path),
                              f"{what}: transformed (e.g. compressed) DCP data is not supported")
    path = os.path.join(folder, info.relative_path)
    if os.path.basename(info.relative_path) != info.relative_path:
        raise CheckpointError(path, "storage path leaves the checkpoint folder")
    fd, size = open_inside(path, folder)  # a FIFO or device refused, not waited on; links kept inside
    try:
        raw = os.pread(fd, min(info.length, max(size - info.offset, 0)), info.offset)
    except OSError as exc:
        raise CheckpointError(path, exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(raw) != info.length:
        raise CheckpointError(path, f"{what}: file ends before byte {info.offset + info.length}")
    try:
        with torch.serialization.safe_globals(STAND_INS):
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(path, f"{what} (bytes {info.offset}+{info.length}): "
                                    f"refused or unreadable: {first}") from None


def _assemble(folder: str, metadata: Any, key: str, entry: Any, chunks: dict) -> Any:
    """A full tensor from its chunks (each a torch.save'd local shard). load_metadata has checked
    that the chunks tile the tensor exactly once and that their storage holds their elements."""
    import torch

    dtype = entry.properties.dtype
    full = torch.zeros(tuple(entry.size), dtype=dtype)
    covered = 0
    for chunk in entry.chunks:
        info = chunks.get((key, tuple(chunk.offsets)))
        if info is None:
            raise CheckpointError(folder, f"{key}: no storage for the chunk at offset {list(chunk.offsets)}")
        part = _read_blob(folder, info, key)
        if not torch.is_tensor(part) or tuple(part.shape) != tuple(chunk.sizes):
            raise CheckpointError(folder, f"{key}: the chunk at {list(chunk.offsets)} is not a tensor of "
                                          f"shape {list(chunk.sizes)}")
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        full[index] = part.to(dtype)
        covered += part.numel()
    if covered != full.numel():
        raise CheckpointError(folder, f"{key}: chunks cover {covered} of {full.numel()} elements")
    return full


def read_dcp(src: str) -> Imported:
    """Read the DCP checkpoint folder `src`."""
    src = os.fspath(src)  # any os.PathLike
    import torch

    folder = src.rstrip("/") or "/"
    if not os.path.isdir(folder):
        raise CheckpointError(folder, "no such DCP checkpoint folder")
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise CheckpointError(folder, "not a DCP checkpoint: no .metadata file")
    metadata = load_metadata(os.path.join(folder, ".metadata"))
    storage = getattr(metadata, "storage_data", None) or {}
    chunks = {(index.fqn, tuple(index.offset) if index.offset is not None else None): info
              for index, info in storage.items()}

    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict[str, Any]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        path = _path_of(metadata, key)
        if type(entry).__name__ == "TensorStorageMetadata":
            value = _assemble(folder, metadata, key, entry, chunks)
        else:
            info = chunks.get((key, None)) or next((i for (k, _), i in chunks.items() if k == key), None)
            if info is None:
                raise CheckpointError(folder, f"{key}: no storage entry")
            value = _read_blob(folder, info, key)
        if path[0] == "model" and len(path) == 2:
            model[str(path[1])] = value
        elif path[:2] == ("optim", "state") and len(path) == 4:
            state.setdefault(str(path[2]), {})[str(path[3])] = value
        elif path[:2] == ("optim", "param_groups") and len(path) == 4:
            groups.setdefault(int(path[2]), {})[str(path[3])] = value
        # anything else (a user's extra entries) is not ours to map
    if not model:
        raise CheckpointError(folder, "no 'model.*' entries: expected dcp.save({'model': ..., 'optim': ...})")

    ordered_groups = [groups[i] for i in sorted(groups)]
    in_groups = [str(n) for g in ordered_groups for n in (g.get("params") or [])]
    names = in_groups or [n for n in state if n in model]
    missing = [n for n in names if n not in model]
    if missing:
        raise CheckpointError(folder, f"optimizer names parameters absent from the model: {', '.join(missing)}")
    imp = Imported(source=f"dcp:{os.path.abspath(folder)}", params={}, zero_stage=3,
                   world_size=len({i.relative_path for i in storage.values()}) or 1)
    for name in names:
        imp.params[name] = model[name].float()
        per_elem = {k: v for k, v in state.get(name, {}).items() if torch.is_tensor(v) and v.dim() >= 1}
        imp.optimizer_state[name] = {k: v.reshape(-1) for k, v in per_elem.items()}
        imp.scalar_state[name] = {k: scalar_json(v, f"optimizer state {k!r}")
                                  for k, v in state.get(name, {}).items() if k not in per_elem}
    for name, value in model.items():
        if name in imp.params:
            continue
        twin = next((p for p in names
                     if imp.params[p].shape == value.shape and torch.equal(imp.params[p], value.float())),
                    None) if value.is_floating_point() else None
        if twin is not None and name not in state:
            imp.aliases[name] = twin  # a tied weight: saved twice by the state dict, one parameter
        else:
            imp.buffers[name] = value
    imp.param_groups = [{**{k: to_json_value(v, f"param group option {k!r}") for k, v in g.items() if k != "params"},
                         "params": list(map(str, g["params"]))}
                        for g in ordered_groups if g.get("params") is not None]
    imp.optimizer_class = optimizer_class_of(imp.param_groups)
    steps = [v["step"]["value"] for v in imp.scalar_state.values() if "step" in v]
    imp.global_steps = imp.micro_steps = int(steps[0]) if steps else 0
    if imp.aliases:
        imp.notes.append("tied weights recognised by equal values: " +
                         ", ".join(f"{a} -> {t}" for a, t in imp.aliases.items()))
    return imp
