"""Full (unsharded) models on disk: one `.safetensors` file, or an HF-style folder of shards
with `model.safetensors.index.json`. Only headers are read here; data comes by ranged reads.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.format.manifest import is_safe_file_name
from zeroshard.storage.location import Location, RangeReader
from zeroshard.storage.safetensors_header import DTYPE_SIZES, read_header

if TYPE_CHECKING:
    import torch

HF_INDEX_NAME = "model.safetensors.index.json"
HF_SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str  # name inside the source folder
    begin: int  # absolute byte offsets in that file
    end: int

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


def strip(name: str, prefixes: list[str]) -> str:
    """`name` without the first of `prefixes` it starts with (DDP's `module.`, torch.compile's `_orig_mod.`)."""
    for prefix in prefixes:
        if prefix and name.startswith(prefix):
            return name[len(prefix):]
    return name


def stripped_names(url: str, names: list[str], strip_prefix: str | list[str] | None,
                   option: str = "--strip-prefix") -> list[str]:
    """`names`, each without the first of `strip_prefix` (one prefix or several) it starts with; a
    name left empty, or two names made one, is an error naming them (and `option`, how the caller
    spells the setting)."""
    prefixes = [strip_prefix] if isinstance(strip_prefix, str) else list(strip_prefix or [])
    out: list[str] = []
    seen: dict[str, str] = {}
    for name in names:
        new = strip(name, prefixes)
        if not new:
            raise ZeroshardError(f"{url}: {option} leaves tensor {name!r} with an empty name")
        if new in seen:
            raise ZeroshardError(f"{url}: {option} makes {seen[new]!r} and {name!r} both {new!r}")
        seen[new] = name
        out.append(new)
    return out


def split_file_url(url: str) -> tuple[str, str]:
    """`s3://b/x/model.safetensors` -> (`s3://b/x`, `model.safetensors`); a bare name -> (`.`, name)."""
    parent, name = posixpath.split(url.rstrip("/"))
    return parent or ".", name


def open_full_model(url: str, storage_options: dict | None = None) -> tuple[Location, list[SourceTensor]]:
    """The folder holding the model's files, and its tensors in file order."""
    target = Location(url, storage_options)
    if target.exists() and not target.isdir():
        parent, name = split_file_url(url)
        folder = Location(parent, storage_options)
        return folder, _file_tensors(folder, name)
    if target.exists(HF_INDEX_NAME):
        return target, indexed_tensors(target, HF_INDEX_NAME, _file_tensors)
    if target.exists(HF_SINGLE_NAME):
        return target, _file_tensors(target, HF_SINGLE_NAME)
    if not target.exists():
        raise CheckpointError(url, "no such file or folder")
    ranks = sorted(n for n in target.list() if _DCP_RANK_FILE.match(n))
    if ranks:
        _file_tensors(target, ranks[0])  # refused there, saying what the files are and what to do
    raise CheckpointError(url, "not a full model: expected a .safetensors or torch.save file, or a folder with "
                               f"{HF_INDEX_NAME}, {HF_SINGLE_NAME}, pytorch_model.bin.index.json or "
                               "pytorch_model.bin")


# DCP's HuggingFaceStorageWriter records in every file it writes where each tensor's piece sits
# in the full tensor. With save_distributed=True each rank writes its own pieces to
# shard-RANK-model-I-of-N.safetensors; a rank-0 save writes full tensors (offsets all 0) to
# model-I-of-N.safetensors. Only the header's offsets and DCP's file name tell the two apart.
DCP_SHARDING_KEY = "DCP_SHARDING_INFO"
_DCP_RANK_FILE = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")


def _holds_dcp_pieces(name: str, metadata: dict[str, str]) -> bool:
    if DCP_SHARDING_KEY not in metadata:
        return False
    if _DCP_RANK_FILE.match(name):
        return True
    try:
        info = json.loads(metadata[DCP_SHARDING_KEY])
        offsets = [o for t in info.values() for o in t.get("saved_offsets", [])]
    except (ValueError, AttributeError, TypeError):
        return False  # not DCP's: the data itself is checked as any file's
    return any(o != 0 for o in offsets)


def _file_tensors(folder: Location, name: str) -> list[SourceTensor]:
    size = folder.size(name)
    with folder.open_reader(name, follow_links=True) as reader:  # HF caches link into a blob store
        header = read_header(reader, size)
    if _holds_dcp_pieces(name, header.metadata):
        raise CheckpointError(folder.url_of(name), "holds one rank's pieces of DCP-sharded tensors (DCP's "
                                                   "HuggingFaceStorageWriter(save_distributed=True)), not full "
                                                   "tensors: name the consolidated files it writes with "
                                                   "enable_consolidation=True (torchtitan's HF export: the folder "
                                                   "above `sharded/`), or consolidate these first (torch.distributed"
                                                   ".checkpoint's consolidate_safetensors_files)")
    entries = sorted(header.entries.items(), key=lambda kv: kv[1].begin)
    return [SourceTensor(n, e.dtype, e.shape, name, e.begin, e.end) for n, e in entries]


def indexed_tensors(folder: Location, index_name: str,
                    file_tensors: Callable[[Location, str], list[SourceTensor]]) -> list[SourceTensor]:
    """The tensors of an HF-style index (`index_name`, a `weight_map` of tensor -> file) and its
    files, each file's read by `file_tensors`; the index and its files must agree."""
    where = folder.url_of(index_name)
    try:
        weight_map = json.loads(folder.read_bytes(index_name))["weight_map"]
        assert isinstance(weight_map, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(where, "not a valid index: expected a JSON object with a 'weight_map'") from None
    files = sorted(set(weight_map.values()))
    for name in files:
        if not isinstance(name, str) or not is_safe_file_name(name):
            raise CheckpointError(where, f"weight_map names {name!r}, which is not a plain file name in the folder")
    out: list[SourceTensor] = []
    for name in files:
        for tensor in file_tensors(folder, name):
            if weight_map.get(tensor.name) != name:  # transformers would load it too: never drop it unsaid
                mapped = weight_map.get(tensor.name)
                raise CheckpointError(folder.url_of(name), f"holds {tensor.name!r}, which {index_name} "
                                      + (f"maps to {mapped!r}" if mapped else "does not name")
                                      + ": the index and its files disagree")
            out.append(tensor)
    missing = set(weight_map) - {t.name for t in out}
    if missing:
        raise CheckpointError(where, f"{len(missing)} tensors in weight_map are not in their files, "
                                     f"e.g. {sorted(missing)[0]!r}")
    return out


def read_source_tensor(reader: RangeReader, tensor: SourceTensor, start: int, end: int) -> "torch.Tensor":
    """Elements [start, end) of `tensor`, read straight into a new 1-D torch tensor."""
    import torch

    from zeroshard.storage.safetensors_header import torch_dtype

    out = torch.empty(end - start, dtype=torch_dtype(tensor.dtype))
    if end > start:
        reader.read_into(tensor.begin + start * tensor.itemsize, memoryview(out.view(torch.uint8).numpy()))
    return out


def read_source_range(reader: RangeReader, tensor: SourceTensor, start: int, end: int, chunk_bytes: int,
                      write) -> None:
    """Stream the bytes of elements [start, end) of `tensor` to `write`, chunk by chunk (two
    alternating buffers: each chunk stays valid until the next write returns)."""
    size = tensor.itemsize
    step = max(1, chunk_bytes // size) * size
    first, last = tensor.begin + start * size, tensor.begin + end * size
    buffers = [memoryview(bytearray(min(step, last - first))) for _ in range(2)]
    for i, offset in enumerate(range(first, last, step)):
        view = buffers[i % 2][:min(step, last - offset)]
        reader.read_into(offset, view)
        write(view)
