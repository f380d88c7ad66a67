"""Reading torch.distributed.checkpoint's `.metadata` without running its code.

The file is a plain pickle, and torch's own reader loads it with pickle.load: whatever a
hostile file names would run. Here a restricted Unpickler resolves only a closed list of
globals: DCP's metadata dataclasses, torch.Size, torch dtypes, the layout/memory-format
helpers and pathlib paths. Everything else is refused before it is called.

DCP's dataclasses are not imported: each is resolved to a stand-in of the same name (`_Record`)
that only takes the pickled fields as attributes, with DCP's defaults. So no DCP code runs
while unpickling, and an import does not pay for `torch.distributed.checkpoint` (its package
imports DTensor and the planners: a 0.1 GiB DCP import took 6.3 s with it, 3.8 s without, here).
"""

from __future__ import annotations

import io
import os
import pickle
import posixpath
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.interop import files

MAX_METADATA_BYTES = 1 << 30
MAX_DIMS = 64
MAX_CHUNKS_PER_TENSOR = 1024  # the overlap check is pairwise
MAX_PATH_PARTS = 64  # a planner_data path: ("optim", "state", fqn, "exp_avg") has four


def _shown(value: Any, limit: int = 40) -> str:
    """`value` for an error message: a plain scalar's repr (cut short), else its type's name
    (the repr of a hostile 10,000-deep list would recurse past Python's limit)."""
    if value is None or isinstance(value, (str, bytes, int, float)):
        return repr(value)[:limit]
    return f"a {type(value).__name__}"

class _Record:
    """A stand-in for one of DCP's metadata dataclasses: the pickled fields become attributes.
    Subclasses carry DCP's name (the importers check `type(x).__name__`) and its defaults."""

    def __setstate__(self, state: Any) -> None:
        # a dataclass pickles its __dict__, or (__dict__, slots) when it has __slots__
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        for part in parts:
            if part is None:
                continue
            if not isinstance(part, dict):
                raise pickle.UnpicklingError(f"{type(self).__name__}: unexpected state {type(part).__name__}")
            for key in part:  # field names only: a dunder (`__setstate__`) would shadow the stand-in's methods
                if not isinstance(key, str) or key.startswith("__"):
                    raise pickle.UnpicklingError(f"{type(self).__name__}: {_shown(key)} is not a field name")
            self.__dict__.update(part)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class _TensorProperties(_Record):
    """DCP's TensorProperties pickles a tuple: (dtype, layout, requires_grad, memory format code,
    pin_memory)."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != 5:
            raise pickle.UnpicklingError("TensorProperties: unexpected state")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


def _memory_format_code(value: Any) -> int:
    """DCP's _MEM_FORMAT_ENCODING enum, unpickled as its value (0 contiguous, 1 channels last,
    2 preserve)."""
    if value not in (0, 1, 2):
        raise pickle.UnpicklingError(f"_MEM_FORMAT_ENCODING: unknown value {_shown(value)}")
    return value


def _write_item_type(value: Any) -> int:
    """DCP's WriteItemType enum (in the save plans Megatron-Core keeps in `.metadata`), unpickled
    as its value (1 tensor, 2 shard, 3 bytes)."""
    if value not in (1, 2, 3):
        raise pickle.UnpicklingError(f"WriteItemType: unknown value {_shown(value)}")
    return value


def _record(name: str, base: type = _Record, **defaults: Any) -> type:
    return type(name, (base,), {"__module__": __name__, **defaults})


_DCP_CLASSES: dict[str, dict[str, Any]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata": _record("Metadata", planner_data=None, storage_data=None, storage_meta=None, version=None),
        "BytesStorageMetadata": _record("BytesStorageMetadata"),
        "ChunkStorageMetadata": _record("ChunkStorageMetadata"),
        "MetadataIndex": _record("MetadataIndex", offset=None, index=None),
        "StorageMeta": _record("StorageMeta", checkpoint_id=None, save_id=None, load_id=None, modules=()),
        "TensorProperties": _record("TensorProperties", _TensorProperties),
        "TensorStorageMetadata": _record("TensorStorageMetadata"),
        "_MEM_FORMAT_ENCODING": _memory_format_code,
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo": _record("_StorageInfo", transform_descriptors=None)},
    "torch.distributed.checkpoint._extension": {"ExtensionRegistry": _record("ExtensionRegistry")},
    # Megatron-Core's torch_dist saves keep every rank's SavePlan in Metadata.all_local_plans (to
    # check a reused plan on the next save); nothing here reads them, the stand-ins only hold them
    "torch.distributed.checkpoint.planner": {
        "SavePlan": _record("SavePlan", storage_data=None, planner_data=None, usable=True),
        "WriteItem": _record("WriteItem", bytes_io_data=None, tensor_data=None),
        "TensorWriteData": _record("TensorWriteData"),
        "WriteItemType": _write_item_type,
    },
}
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if name in _DCP_CLASSES.get(module, {}):
            return _DCP_CLASSES[module][name]
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout  # maps a layout's name to torch.strided etc.
        if module == "pathlib" and name in _PATHS:
            import pathlib

            return getattr(pathlib, name)
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(f"global {module}.{name} is not on the allowlist")


def load_metadata(path: str) -> Any:
    """The Metadata object of a DCP checkpoint's `.metadata` file, checked (check_metadata)
    against the files it points into before anything is allocated from it."""
    path = os.fspath(path)  # any os.PathLike; a local path or a URL
    raw = files.read_inside(path, files.parent(path), MAX_METADATA_BYTES, "DCP metadata")
    try:
        metadata = _Restricted(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(path, f"refused to unpickle: {exc}") from None
    except Exception as exc:  # truncated or foreign bytes: any unpickling error means unreadable
        raise CheckpointError(path, f"not a readable DCP metadata file: {type(exc).__name__}: {exc}") from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(path, f"not DCP metadata (a {type(metadata).__name__})")
    check_metadata(path, metadata)
    return metadata


def _dims(value: Any) -> tuple[int, ...] | None:
    """`value` as a shape or offset (non-negative integers), None if it is not one."""
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS:
        return None
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in value):
        return None
    return tuple(value)


def _volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return n


def _check_tiling(path: str, key: str, size: tuple[int, ...], chunks: Any) -> list[tuple[tuple, tuple]]:
    """The chunks of tensor `key` must tile it exactly once: in bounds, no two overlapping, and
    (then equivalently) no gap."""
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS_PER_TENSOR:
        raise CheckpointError(path, f"{key}: chunks must be a list of at most {MAX_CHUNKS_PER_TENSOR}")
    boxes = []
    for chunk in chunks:
        offsets, sizes = _dims(getattr(chunk, "offsets", None)), _dims(getattr(chunk, "sizes", None))
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
            raise CheckpointError(path, f"{key}: a chunk's offsets/sizes are not {len(size)} non-negative integers")
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise CheckpointError(path, f"{key}: the chunk at {list(offsets)} of size {list(sizes)} lies outside "
                                        f"the tensor's size {list(size)}")
        boxes.append((offsets, sizes))
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1:]:
            if all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size)) \
                    and _volume(a_size) and _volume(b_size):
                raise CheckpointError(path, f"{key}: the chunks at {list(a_off)} and {list(b_off)} overlap")
    covered = sum(_volume(s) for _, s in boxes)
    if covered != _volume(size):
        raise CheckpointError(path, f"{key}: the chunks cover {covered} of its {_volume(size)} elements")
    return boxes


def _check_storage(path: str, storage: Any) -> dict[tuple[str, Any], Any]:
    """storage_data: every entry a plain file name in the folder with a byte range inside that
    file, no two ranges of a file overlapping. Returns {(fqn, offsets or None): info}."""
    folder = files.parent(path)
    if not isinstance(storage, dict):
        raise CheckpointError(path, f"storage_data must be a dict, got {type(storage).__name__}")
    sizes: dict[str, int] = {}
    ranges: dict[str, list[tuple[int, int]]] = {}
    by_key = {}
    for index, info in storage.items():
        fqn, name = getattr(index, "fqn", None), getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(fqn, str):
            raise CheckpointError(path, f"a storage entry names {_shown(fqn)}, not a key")
        if not isinstance(name, str) or posixpath.basename(name) != name or name in ("", ".", "..") or "\0" in name:
            raise CheckpointError(path, f"{fqn}: storage path {_shown(name, 80)} is not a file name in the folder")
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in (offset, length)):
            raise CheckpointError(path, f"{fqn}: storage offset/length {_shown(offset)}/{_shown(length)} are not "
                                        "non-negative integers")
        if name not in sizes:
            sizes[name] = files.size_inside(files.join(folder, name), folder)
        if offset + length > sizes[name]:
            raise CheckpointError(files.join(folder, name), f"{fqn}: bytes {offset}+{length} run past its end "
                                                                f"({sizes[name]} bytes)")
        ranges.setdefault(name, []).append((offset, length))
        where = getattr(index, "offset", None)
        dims = None if where is None else _dims(where)
        if where is not None and dims is None:
            raise CheckpointError(path, f"{fqn}: storage entry offset {_shown(where, 60)} is not a position")
        if getattr(info, "transform_descriptors", None) is not None \
                and not isinstance(info.transform_descriptors, (list, tuple)):
            raise CheckpointError(path, f"{fqn}: transform_descriptors is not a list")
        by_key[(fqn, dims)] = info
    for name, spans in ranges.items():
        spans.sort()
        for (a, alen), (b, _) in zip(spans, spans[1:]):
            if a + alen > b:
                raise CheckpointError(files.join(folder, name), f"two entries share bytes {b}..{a + alen}")
    return by_key


def check_metadata(path: str, metadata: Any) -> None:
    """Every type, size, offset and count in `metadata` checked against the files before any data
    is read: tensors' chunks tile them exactly once, each chunk has a byte range in a regular file
    of the folder at least as long as its elements, ranges do not share bytes (so the tensors'
    total size is bounded by the files' size)."""
    import torch

    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise CheckpointError(path, f"state_dict_metadata must be a dict, got {type(entries).__name__}")
    planner = getattr(metadata, "planner_data", None)
    if planner is not None and not isinstance(planner, dict):
        raise CheckpointError(path, f"planner_data must be a dict, got {type(planner).__name__}")
    for key, where in (planner or {}).items():  # each a path: ("model", "fc.weight"), ("optim", "state", ...)
        if not isinstance(key, str):
            raise CheckpointError(path, f"planner_data: a key is {_shown(key)}, not a string")
        if not isinstance(where, (tuple, list)) or len(where) > MAX_PATH_PARTS or any(
                isinstance(p, bool) or not isinstance(p, (str, int)) for p in where):
            raise CheckpointError(path, f"planner_data: {key[:80]!r} maps to {_shown(where)}, not a path of at most "
                                        f"{MAX_PATH_PARTS} names and indices")
    tiles: dict[str, tuple[Any, list[tuple[tuple, tuple]]]] = {}
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise CheckpointError(path, f"a key is {_shown(key)}, not a string")
        kind = type(entry).__name__
        if kind == "BytesStorageMetadata":
            continue
        if kind != "TensorStorageMetadata":
            raise CheckpointError(path, f"{key}: a {kind}, not tensor or bytes metadata")
        dtype = getattr(getattr(entry, "properties", None), "dtype", None)
        size = _dims(getattr(entry, "size", None))
        if not isinstance(dtype, torch.dtype) or size is None:
            raise CheckpointError(path, f"{key}: no dtype, or a size that is not non-negative integers")
        tiles[key] = (dtype, _check_tiling(path, key, size, getattr(entry, "chunks", None)))
    storage = _check_storage(path, metadata.storage_data)
    stored_keys = {k for k, _ in storage}
    for key in entries:
        if key not in tiles and key not in stored_keys:
            raise CheckpointError(path, f"{key}: no storage entry")
    for key, (dtype, boxes) in tiles.items():
        for offsets, sizes in boxes:
            info = storage.get((key, offsets))
            if info is None:
                raise CheckpointError(path, f"{key}: no storage for the chunk at offset {list(offsets)}")
            if info.length < _volume(sizes) * dtype.itemsize:
                raise CheckpointError(path, f"{key}: the chunk at {list(offsets)} holds {_volume(sizes)} elements "
                                            f"but its storage is only {info.length} bytes")
