"""Reading torch.distributed.checkpoint's `.metadata` without running its code.

The file is a plain pickle, and torch's own reader loads it with pickle.load: whatever a
hostile file names would run. Here a restricted Unpickler resolves only a closed list of
globals: DCP's metadata dataclasses, torch.Size, torch dtypes, the layout/memory-format
helpers and pathlib paths. Everything else is refused before it is called.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from zeroshard.errors import CheckpointError

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                              "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"ExtensionRegistry"},
}
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import importlib

        import torch

        if name in _DCP_CLASSES.get(module, ()):
            return getattr(importlib.import_module(module), name)
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
    """The Metadata object of a DCP checkpoint's `.metadata` file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise CheckpointError(path, exc.strerror or str(exc)) from None
    try:
        metadata = _Restricted(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointError(path, f"refused to unpickle: {exc}") from None
    except Exception as exc:  # truncated or foreign bytes: any unpickling error means unreadable
        raise CheckpointError(path, f"not a readable DCP metadata file: {type(exc).__name__}: {exc}") from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(path, f"not DCP metadata (a {type(metadata).__name__})")
    return metadata
