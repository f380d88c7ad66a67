"""Full models saved with torch.save, read as format/full_model.py reads safetensors ones: each
tensor a byte range of its file, copied by range (`zeroshard shard`, `load_pretrained`).

Accepted: a torch.save zip archive (`pytorch_model.bin`, `model.pt`, DeepSpeed's `zero_to_fp32`
output), or a folder with `pytorch_model.bin` or `pytorch_model.bin.index.json` and its shards
when it has no safetensors weights (transformers prefers those, and so do we). The archive's
pickle goes through torch_zip's closed allowlist; no tensor byte is read here.

[Note: which entry is the model] A file holds either a state dict (every value a tensor) or a
training script's dict around one (nanoGPT's `{"model": ..., "optimizer": ..., "iter_num": ...}`,
Lightning's `{"state_dict": ...}`). In the second case the one entry that is a state dict is the
model, and the caller says which entries were left beside it: weights only, as `shard` promises,
never a silent pick. Two such entries, tensors beside them, or anything else: refused, naming the
entries. DeepSpeed's per-rank model-states files look like the second case but are not full
models (stage 3's hold empty placeholders, bf16 ones 16-bit copies of the fp32 masters): refused,
pointing at `zeroshard import deepspeed`.
"""

from __future__ import annotations

import os
from typing import Any

from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.format.full_model import (
    HF_INDEX_NAME,
    HF_SINGLE_NAME,
    SourceTensor,
    indexed_tensors,
    open_full_model,
    split_file_url,
)
from zeroshard.interop import files, torch_zip
from zeroshard.storage.location import Location, local_path
from zeroshard.storage.safetensors_header import dtype_name

PICKLED_SINGLE_NAME = "pytorch_model.bin"
PICKLED_INDEX_NAME = "pytorch_model.bin.index.json"
_ZIP_MAGIC = b"PK\x03\x04"
_DEEPSPEED_KEYS = ("ds_version", "ds_config")


def open_model(url: str, storage_options: dict | None = None) -> tuple[Location, list[SourceTensor], list[str]]:
    """A full model in safetensors or torch.save's format: the folder holding its files, its
    tensors in file order, and notes on what of a pickle was left beside the model."""
    target = Location(url, storage_options)
    with files.storage_options(storage_options):
        if target.exists() and not target.isdir():
            if target.read_bytes("", 0, 4) != _ZIP_MAGIC:
                return (*open_full_model(url, storage_options), [])
            parent, name = split_file_url(url)
            folder = Location(parent, storage_options)
            return folder, *_pickled_file(folder, name, shown=url)
        names = target.list()
        if HF_INDEX_NAME not in names and HF_SINGLE_NAME not in names:
            if PICKLED_INDEX_NAME in names:
                return target, indexed_tensors(target, PICKLED_INDEX_NAME, _flat_pickled_file), []
            if PICKLED_SINGLE_NAME in names:
                return target, *_pickled_file(target, PICKLED_SINGLE_NAME)
    return (*open_full_model(url, storage_options), [])


def _flat_pickled_file(folder: Location, name: str) -> list[SourceTensor]:
    tensors, notes = _pickled_file(folder, name)
    if notes:  # a shard of an index is a plain state dict, as transformers writes it
        raise CheckpointError(folder.url_of(name), "is a shard of an index but not a plain state dict")
    return tensors


def _pickled_file(folder: Location, name: str, shown: str = "") -> tuple[list[SourceTensor], list[str]]:
    path = shown or folder.url_of(name)  # errors name the file as the user gave it
    if name.endswith(".distcp"):
        raise CheckpointError(path, "is one file of a DCP checkpoint: import its folder with `zeroshard import dcp`")
    loaded = torch_zip.locate(path, _root_of(path))
    entries, notes = _model_entries(path, loaded)
    out = []
    for key, stored in entries.items():
        try:
            dtype = dtype_name(stored.dtype)
        except ZeroshardError:
            raise CheckpointError(path, f"tensor {key!r} is {stored.dtype}, which safetensors cannot hold") from None
        out.append(SourceTensor(key, dtype, stored.shape, name, stored.offset, stored.offset + stored.nbytes))
    return sorted(out, key=lambda t: t.begin), notes


def _root_of(path: str) -> str:
    """The folder a pickle's reads must stay inside: its own, after links (HF's cache links each
    file into a blob store, as format/full_model.py follows for safetensors)."""
    local = local_path(path)
    return os.path.dirname(os.path.realpath(local)) if local is not None else files.parent(path)


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, str) and isinstance(v, torch_zip.StoredTensor) for k, v in value.items())


def _model_entries(path: str, loaded: Any) -> tuple[dict[str, torch_zip.StoredTensor], list[str]]:
    """The state dict in `loaded` and notes on what was left (see [Note: which entry is the model])."""
    if not isinstance(loaded, dict) or not loaded:
        raise CheckpointError(path, f"holds {'an empty dict' if loaded == {} else 'a ' + type(loaded).__name__}, "
                                    "not a model's state dict")
    if any(k in loaded for k in _DEEPSPEED_KEYS) or path.endswith("model_states.pt"):
        raise CheckpointError(path, "is a DeepSpeed model-states file, not a full model: import the checkpoint "
                                    "folder with `zeroshard import deepspeed`")
    if _is_state_dict(loaded):
        return loaded, []
    keys = list(loaded)
    shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    models = [k for k, v in loaded.items() if _is_state_dict(v)]
    loose = [k for k, v in loaded.items() if isinstance(v, torch_zip.StoredTensor)]
    if len(models) == 1 and not loose:
        model = models[0]
        left = ", ".join(repr(k) for k in keys if k != model)
        return loaded[model], [f"{path}: took the {len(loaded[model])} tensors of entry {model!r} as the model"
                               + (f"; left beside it: {left}" if left else "")]
    if loose:
        odd = next(k for k, v in loaded.items() if not isinstance(v, torch_zip.StoredTensor))
        raise CheckpointError(path, f"holds tensors beside {odd!r} ({type(loaded[odd]).__name__}): not a model's "
                                    f"state dict (entries: {shown})")
    raise CheckpointError(path, f"holds {'several state dicts' if models else 'no state dict'} among its entries "
                                f"({shown}): not one model; save the model's state_dict() alone")
