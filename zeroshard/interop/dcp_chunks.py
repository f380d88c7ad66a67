"""The bytes of a DCP checkpoint: torch.save'd blobs at byte ranges of its files, and tensors
read from their chunks by flat element range.

With torch's default writer each chunk of a tensor is a small torch.save blob at a byte range
of a .distcp file. A tensor is read lazily (LazyTensor): a flat range [start, end) needs the
rows along dimension 0 that hold it, which come from the chunks overlapping those rows (FSDP2
shards dimension 0, so that is one or two chunks); torch_zip.py finds each chunk's storage in
its blob, and only the bytes of those rows are read. Memory holds the range, never the model.
load_metadata (dcp_metadata.py) has checked that the chunks tile each tensor exactly once and
that their storage lies inside the files. Plain values (bytes entries) are read whole.
"""

from __future__ import annotations

import math
import posixpath
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.interop import files, torch_zip
from zeroshard.interop.imported import LazyTensor, flat_range, is_tensor, materialize
from zeroshard.interop.torch_pickle import allowlist, checked_load

LAZY_BYTES = 1 << 20  # tensors this big (with a dimension) are read on demand; smaller ones at once


def read_blob(folder: str, info: Any, what: str) -> Any:
    """The object torch.save'd at `info`'s byte range (a tensor chunk or a plain value)."""

    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(files.join(folder, info.relative_path),
                              f"{what}: transformed (e.g. compressed) DCP data is not supported")
    path = files.join(folder, info.relative_path)
    if posixpath.basename(info.relative_path) != info.relative_path:
        raise CheckpointError(path, "storage path leaves the checkpoint folder")
    reader, size = files.open_inside(path, folder)  # a FIFO or device refused, not waited on; links kept inside
    with reader:
        if info.offset + info.length > size:
            raise CheckpointError(path, f"{what}: file ends before byte {info.offset + info.length}")
        raw = files.read_range(reader, path, info.offset, info.length)
    allowed = allowlist()
    try:
        with allowed:
            return checked_load(path, raw)  # sizes checked against the blob's bytes first
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(path, f"{what} (bytes {info.offset}+{info.length}): "
                                    f"refused or unreadable: {first}") from None


def _chunk(folder: str, key: str, chunk: Any, chunks: dict) -> Any:
    """The chunk's tensor, a LazyTensor when torch's zip format lets it be read by range (a
    blob in torch's legacy format is read whole)."""
    info = chunks.get((key, tuple(chunk.offsets)))
    if info is None:
        raise CheckpointError(folder, f"{key}: no storage for the chunk at offset {list(chunk.offsets)}")
    path = files.join(folder, info.relative_path)
    if getattr(info, "transform_descriptors", None) or posixpath.basename(info.relative_path) != info.relative_path:
        return _checked(folder, key, chunk, read_blob(folder, info, key))  # refused there, one line
    try:
        source = torch_zip.open_archive(path, folder, info.offset, info.length)
        if not torch_zip.is_zip(source):
            return _checked(folder, key, chunk, read_blob(folder, info, key))  # torch's legacy format: whole
        part = torch_zip.load(source, lazy_bytes=0)
    except CheckpointError as exc:
        if exc.where != path:
            raise
        raise CheckpointError(path, f"{key} (bytes {info.offset}+{info.length}): {exc.problem}") from None
    return _checked(folder, key, chunk, part)


def _checked(folder: str, key: str, chunk: Any, part: Any) -> Any:
    if not is_tensor(part) or tuple(part.shape) != tuple(chunk.sizes):
        raise CheckpointError(folder, f"{key}: the chunk at {list(chunk.offsets)} is not a tensor of "
                                      f"shape {list(chunk.sizes)}")
    return part


def read_rows(folder: str, key: str, entry: Any, chunks: dict, start: int, end: int) -> Any:
    """Flat elements [start, end) of tensor `key`: from each chunk overlapping their rows, only
    the bytes of those rows."""
    import torch

    size, dtype = tuple(entry.size), entry.properties.dtype
    row = math.prod(size[1:]) if size else 1
    if not size or row == 0 or start >= end:
        whole = torch.zeros(size, dtype=dtype)
        for chunk in entry.chunks:
            index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            whole[index] = materialize(_chunk(folder, key, chunk, chunks)).to(dtype)
        return whole.reshape(-1)[start:end]
    r0, r1 = start // row, -(-end // row)
    for chunk in entry.chunks:  # the usual case: one full-width chunk holds the whole range, read as is
        c0, cn = chunk.offsets[0], chunk.sizes[0]
        if c0 <= r0 and r1 <= c0 + cn and tuple(chunk.sizes[1:]) == size[1:]:
            part = flat_range(_chunk(folder, key, chunk, chunks), start - c0 * row, end - c0 * row)
            return part.to(dtype)
    rows = torch.empty((r1 - r0, *size[1:]), dtype=dtype)
    for chunk in entry.chunks:
        c0, cn = chunk.offsets[0], chunk.sizes[0]
        lo, hi = max(r0, c0), min(r1, c0 + cn)
        if lo >= hi:
            continue
        chunk_row = math.prod(chunk.sizes[1:])
        part = flat_range(_chunk(folder, key, chunk, chunks), (lo - c0) * chunk_row, (hi - c0) * chunk_row)
        index = (slice(lo - r0, hi - r0), *(slice(o, o + s) for o, s in zip(chunk.offsets[1:], chunk.sizes[1:])))
        rows[index] = part.reshape(hi - lo, *chunk.sizes[1:]).to(dtype)
        del part
    return rows.reshape(-1)[start - r0 * row: end - r0 * row]


def tensor(folder: str, key: str, entry: Any, chunks: dict) -> Any:
    """Tensor `key`: read now when small or 0-d, else a LazyTensor reading by range."""
    import torch

    size, dtype = tuple(entry.size), entry.properties.dtype
    numel = math.prod(size)
    if not size or numel * torch.empty((), dtype=dtype).element_size() < LAZY_BYTES:
        return read_rows(folder, key, entry, chunks, 0, numel).reshape(size)
    return LazyTensor(size, dtype, files.bound(lambda start, end: read_rows(folder, key, entry, chunks, start, end)))
