"""Reading a torch.save zip archive by record, without loading its storages.

torch.save writes a zip (stored, not compressed): `<name>/data.pkl` (the pickle) and one record
`<name>/data/<key>` per storage. Here the zip's central directory is parsed by us (so a hostile
archive meets our checks, not miniz's), `data.pkl` is unpickled by torch's weights_only
unpickler with the closed allowlist of torch_pickle.py, and each storage becomes a meta-device
storage of the record's size: torch's own rebuild functions then give every tensor its shape,
strides and offset without a byte of data. Afterwards each tensor is read at once when small,
or becomes a LazyTensor that preads only the bytes of the flat range asked for.

The archive may be a byte range of a bigger file (a DCP .distcp file holds many at offsets).
Refused with one CheckpointError naming the file, nothing run: compressed or encrypted records,
records past the archive's end or overlapping, duplicate names, storages whose size disagrees
with their pickle, views reaching past their storage or declaring more bytes than it holds
(stride 0), sparse or storage-less tensors.
"""

from __future__ import annotations

import enum
import io
import math
import struct
import sys
from dataclasses import dataclass
from typing import Any

from zeroshard.errors import CheckpointError, StorageError
from zeroshard.interop import files
from zeroshard.interop.imported import LazyTensor
from zeroshard.interop.torch_pickle import MAX_NESTING, allowlist, first_line
from zeroshard.storage.location import RangeReader

LAZY_BYTES = 1 << 20  # tensors this big are read on demand; smaller ones at once
MAX_PICKLE_BYTES = 256 << 20  # data.pkl is read whole: a structure, never the tensors' bytes
MAX_STRIDED_BYTES = 64 << 20  # a non-contiguous view is read whole (at once); bigger ones are refused
_EOCD, _EOCD64, _LOC64 = 0x06054B50, 0x06064B50, 0x07064B50
_CENTRAL, _LOCAL = 0x02014B50, 0x04034B50


@dataclass(frozen=True)
class Record:
    name: str
    offset: int  # of its first data byte, in the file
    size: int


class Source:
    """The byte range [base, base + length) of a file that holds the archive, read through a
    storage RangeReader (os.preadv locally; ranged GETs with read-ahead on S3). The reader is
    closed when no tensor reads from it any more."""

    def __init__(self, path: str, reader: RangeReader, base: int, length: int) -> None:
        self.path, self.reader, self.base, self.length = path, reader, base, length

    def __del__(self) -> None:
        try:
            self.reader.close()
        except (StorageError, OSError, AttributeError):
            pass

    def pread(self, n: int, offset: int) -> bytes:
        """Exactly `n` bytes at `offset` of the archive."""
        if offset < 0 or n < 0 or offset + n > self.length:
            raise CheckpointError(self.path, f"zip structure points past the archive's end (bytes {offset}+{n} "
                                             f"of {self.length})")
        return files.read_range(self.reader, self.path, self.base + offset, n)

    def read_into(self, tensor: Any, offset: int) -> None:
        """Fill the uint8 `tensor` from archive byte `offset` (no intermediate copy)."""
        view = memoryview(tensor.numpy())
        try:
            self.reader.read_into(self.base + offset, view)
        except StorageError as exc:
            problem = f"file ends before byte {self.base + offset + len(view)}" if "truncated" in exc.problem \
                else exc.problem
            raise CheckpointError(self.path, problem) from None


def is_zip(src: Source) -> bool:
    """Whether `src` starts as a zip does (torch's legacy format starts with a pickle)."""
    return src.length >= 4 and src.pread(4, 0) == struct.pack("<I", _LOCAL)


def read_directory(src: Source) -> dict[str, Record]:
    """name -> Record of every entry of the zip at `src`, checked (see the module docstring)."""
    tail_len = min(src.length, 22 + 65535)
    tail = src.pread(tail_len, src.length - tail_len)
    at = tail.rfind(struct.pack("<I", _EOCD))
    if at < 0:
        raise CheckpointError(src.path, "no zip end record: a torch.save archive cut short, or not one")
    if tail_len - at < 22:
        raise CheckpointError(src.path, "zip end record is cut short")
    eocd = src.length - tail_len + at
    disk, cd_disk, _, count, cd_size, cd_offset, _ = struct.unpack("<HHHHIIH", tail[at + 4: at + 22])
    if 0xFFFFFFFF in (cd_size, cd_offset) or count == 0xFFFF:  # zip64: the real fields are elsewhere
        if eocd < 20:
            raise CheckpointError(src.path, "zip64 end record missing")
        sig, _, eocd64, _ = struct.unpack("<IIQI", src.pread(20, eocd - 20))
        if sig != _LOC64:
            raise CheckpointError(src.path, "zip64 end record locator missing")
        rec = src.pread(56, eocd64)
        sig, _, _, _, disk, cd_disk, _, count, cd_size, cd_offset = struct.unpack("<IQHHIIQQQQ", rec)
        if sig != _EOCD64:
            raise CheckpointError(src.path, "zip64 end record missing")
        eocd = eocd64
    if disk or cd_disk:
        raise CheckpointError(src.path, "multi-disk zip archives are not torch files")
    if cd_offset + cd_size > eocd or count > cd_size // 46:
        raise CheckpointError(src.path, f"zip central directory ({count} entries, {cd_size} bytes at {cd_offset}) "
                                        "does not fit in the archive")
    central = src.pread(cd_size, cd_offset)
    records: dict[str, Record] = {}
    spans = []
    pos = 0
    for _ in range(count):
        if pos + 46 > len(central):
            raise CheckpointError(src.path, "zip central directory is cut short")
        (sig, _, _, flags, method, _, _, _, csize, usize, nlen, xlen, clen, _, _, _,
         header) = struct.unpack("<IHHHHHHIIIHHHHHII", central[pos: pos + 46])
        raw_name = central[pos + 46: pos + 46 + nlen]
        extra = central[pos + 46 + nlen: pos + 46 + nlen + xlen]
        pos += 46 + nlen + xlen + clen
        if sig != _CENTRAL or pos > len(central):
            raise CheckpointError(src.path, "zip central directory is damaged")
        name = raw_name.decode("utf-8", "replace")
        usize, csize, header = _zip64_fields(src.path, name, extra, usize, csize, header)
        if method != 0 or flags & 1:
            raise CheckpointError(src.path, f"record {name!r} is compressed or encrypted (torch.save stores "
                                            "records uncompressed); not read")
        if csize != usize:
            raise CheckpointError(src.path, f"record {name!r}: stored size {csize} differs from its size {usize}")
        if name in records:
            raise CheckpointError(src.path, f"record {name!r} appears twice in the zip directory")
        local = src.pread(30, header)
        lsig, _, _, _, _, _, _, _, _, lnlen, lxlen = struct.unpack("<IHHHHHIIIHH", local)
        if lsig != _LOCAL or src.pread(lnlen, header + 30) != raw_name:
            raise CheckpointError(src.path, f"record {name!r}: its local header does not match the directory")
        start = header + 30 + lnlen + lxlen
        if start + usize > cd_offset:
            raise CheckpointError(src.path, f"record {name!r} ({usize} bytes at {start}) runs past the archive's "
                                            "data (absurd size?)")
        records[name] = Record(name, src.base + start, usize)
        spans.append((header, start + usize, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise CheckpointError(src.path, f"records {first!r} and {second!r} overlap")
    return records


def _zip64_fields(path: str, name: str, extra: bytes, usize: int, csize: int, header: int) -> tuple[int, int, int]:
    """Sizes and header offset, from the zip64 extra field where the 32-bit ones are saturated."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[pos: pos + 4])
        body = extra[pos + 4: pos + 4 + size]
        pos += 4 + size
        if tag != 1:
            continue
        values, at = [], 0
        for field in (usize, csize, header):
            if field == 0xFFFFFFFF:
                if at + 8 > len(body):
                    raise CheckpointError(path, f"record {name!r}: zip64 field cut short")
                values.append(struct.unpack("<Q", body[at: at + 8])[0])
                at += 8
            else:
                values.append(field)
        return values[0], values[1], values[2]
    if 0xFFFFFFFF in (usize, csize, header):
        raise CheckpointError(path, f"record {name!r}: zip64 sizes missing")
    return usize, csize, header


def load(src: Source, lazy_bytes: int | None = None) -> Any:
    """The object torch.save'd in the archive at `src`: tensors of fewer than `lazy_bytes`
    (default LAZY_BYTES) bytes read now, bigger ones LazyTensors reading by range."""
    value, refs = _unpickle(src)
    return _Reader(src, refs, LAZY_BYTES if lazy_bytes is None else lazy_bytes).walk(value, 0)


@dataclass(frozen=True)
class StoredTensor:
    """A contiguous tensor of an archive: its bytes are [offset, offset + nbytes) of the file."""
    shape: tuple[int, ...]
    dtype: Any  # a torch.dtype
    offset: int
    nbytes: int


def locate(path: str, folder: str) -> Any:
    """The object torch.save'd at `path` (a file inside `folder`) with each tensor replaced by a
    StoredTensor: for readers that copy byte ranges. Nothing but the pickle is read."""
    src = open_archive(path, folder)
    if not is_zip(src):
        raise CheckpointError(path, "is in torch's legacy (before 1.6, not zip) format, which is not read by "
                                    "range: load it and torch.save it again with a current torch")
    value, refs = _unpickle(src)
    return _Locator(src, refs, 0).walk(value, 0)


def _unpickle(src: Source) -> tuple[Any, dict[int, Record]]:
    """The archive's object with meta-device tensors, and each meta storage's record."""
    import pickle

    import torch
    from torch import _weights_only_unpickler

    records = read_directory(src)
    if not records:
        raise CheckpointError(src.path, "empty zip archive, not a torch file")
    prefix = next(iter(records)).split("/", 1)[0] + "/"  # torch's archive name: the first record's folder
    pkl = records.get(prefix + "data.pkl")
    if pkl is None:
        raise CheckpointError(src.path, "no data.pkl record: not a torch.save archive")
    if pkl.size > MAX_PICKLE_BYTES:
        raise CheckpointError(src.path, f"data.pkl is {pkl.size} bytes, more than the {MAX_PICKLE_BYTES} read")
    order = records.get(prefix + "byteorder")
    if order is not None and src.pread(min(order.size, 16), order.offset - src.base) != sys.byteorder.encode():
        raise CheckpointError(src.path, "was saved with another byte order; not supported")
    storages: dict[str, Any] = {}
    refs: dict[int, Record] = {}

    def persistent_load(saved_id: Any) -> Any:
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise pickle.UnpicklingError(f"unexpected storage reference {str(saved_id)[:60]}")
        _, storage_type, key, _, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(key, str) or isinstance(numel, bool) \
                or not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError(f"unexpected storage reference {str(saved_id)[:60]}")
        if key not in storages:
            record = records.get(f"{prefix}data/{key}")
            if record is None:
                raise CheckpointError(src.path, f"no record data/{key} for a storage of the pickle")
            nbytes = numel * torch._utils._element_size(dtype)
            if nbytes != record.size:
                raise CheckpointError(src.path, f"record data/{key} holds {record.size} bytes, its storage "
                                                f"says {nbytes}")
            storage = torch.UntypedStorage(nbytes, device="meta")  # shape and offsets, no bytes
            storages[key] = storage
            refs[storage._cdata] = record
        return torch.storage.TypedStorage(wrap_storage=storages[key], dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(src.pread(pkl.size, pkl.offset - src.base)),
                                                  encoding="utf-8")
    unpickler.persistent_load = persistent_load
    allowed = allowlist()
    try:
        with allowed:
            value = unpickler.load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, AttributeError, TypeError) as exc:
        raise CheckpointError(src.path, f"refused to unpickle: {first_line(exc)}") from None
    except (RuntimeError, EOFError, ValueError, MemoryError, RecursionError, IndexError, KeyError) as exc:
        raise CheckpointError(src.path, f"not a readable torch file: {first_line(exc)}") from None
    return value, refs


class _Reader:
    """Replaces the meta tensors of an unpickled object by real tensors or LazyTensors."""

    def __init__(self, src: Source, refs: dict[int, Record], lazy_bytes: int) -> None:
        self.src, self.refs, self.lazy_bytes, self.done = src, refs, lazy_bytes, {}

    def walk(self, value: Any, depth: int) -> Any:
        import torch

        if depth > MAX_NESTING:
            raise CheckpointError(self.src.path, f"nested deeper than {MAX_NESTING} levels")
        if torch.is_tensor(value):
            if id(value) not in self.done:
                self.done[id(value)] = (value, self.tensor(value))
            return self.done[id(value)][1]
        if id(value) in self.done:  # a container the pickle holds twice: replaced in place already
            return value
        if isinstance(value, (dict, list)) or hasattr(value, "__dict__"):
            self.done[id(value)] = (value, value)
        if isinstance(value, dict):
            for key, item in value.items():
                value[key] = self.walk(item, depth + 1)
        elif isinstance(value, list):
            value[:] = [self.walk(item, depth + 1) for item in value]
        elif type(value) is tuple:
            return tuple(self.walk(item, depth + 1) for item in value)
        elif hasattr(value, "__dict__") and not isinstance(value, (type, enum.Enum)):  # the stand-ins
            for key, item in list(vars(value).items()):
                new = self.walk(item, depth + 1)
                if new is not item:
                    setattr(value, key, new)
        return value

    def tensor(self, meta: Any) -> Any:
        import torch

        record, first, span = self._storage_of(meta)
        shape, dtype, size = tuple(meta.shape), meta.dtype, meta.element_size()
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        if not meta.is_contiguous():
            if span * size > MAX_STRIDED_BYTES:
                raise CheckpointError(self.src.path, f"a non-contiguous tensor of shape {list(shape)} spans "
                                                     f"{span * size} bytes; more than {MAX_STRIDED_BYTES} not read")
            whole = self._read(record, first * size, span * size).view(dtype)
            return whole.as_strided(shape, meta.stride()).clone()

        def read(start: int, end: int) -> Any:
            start, end = max(0, start), min(numel, end)
            return self._read(record, (first + start) * size, max(end - start, 0) * size).view(dtype)

        if numel * size < self.lazy_bytes or not shape:
            return read(0, numel).reshape(shape)
        return LazyTensor(shape, dtype, read)

    def _storage_of(self, meta: Any) -> tuple[Record, int, int]:
        """The record holding a meta tensor's storage, the view's first element and how many
        elements it reaches, checked to lie inside the record."""
        import torch

        if meta.layout != torch.strided or not meta.is_meta:
            raise CheckpointError(self.src.path, f"holds a {meta.layout} tensor; only dense tensors are read")
        record = self.refs.get(meta.untyped_storage()._cdata)
        if record is None:
            raise CheckpointError(self.src.path, "holds a tensor with no storage record")
        first, shape = meta.storage_offset(), tuple(meta.shape)
        span = 1 + sum((n - 1) * s for n, s in zip(shape, meta.stride()))  # elements the view reaches
        outside = (first + span) * meta.element_size() > record.size or any(s < 0 for s in meta.stride())
        if math.prod(shape) and outside:
            raise CheckpointError(self.src.path, f"a tensor of shape {list(shape)} reaches past its storage "
                                                 f"{record.name!r} ({record.size} bytes)")
        declared = math.prod(shape) * meta.element_size()
        if declared > record.size:  # stride 0 or overlapping strides: a copy would allocate all of it
            raise CheckpointError(self.src.path, f"a tensor of shape {list(shape)} declares {declared} bytes over "
                                                 f"its storage {record.name!r} of {record.size} (a stride-0 or "
                                                 "overlapping view): refused before allocating")
        return record, first, span

    def _read(self, record: Record, offset: int, nbytes: int) -> Any:
        """`nbytes` bytes from `offset` of `record`, as a fresh uint8 tensor."""
        import torch

        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self.src.read_into(out, record.offset - self.src.base + offset)
        return out


class _Locator(_Reader):
    """Replaces the meta tensors of an unpickled object by StoredTensors."""

    def tensor(self, meta: Any) -> StoredTensor:
        record, first, _ = self._storage_of(meta)
        if not meta.is_contiguous():
            raise CheckpointError(self.src.path, f"holds a non-contiguous view of shape {list(meta.shape)}, which is "
                                                 "not read by range: save its .contiguous() copy")
        nbytes = math.prod(meta.shape) * meta.element_size()
        return StoredTensor(tuple(meta.shape), meta.dtype, record.offset + first * meta.element_size(), nbytes)


def open_archive(path: str, folder: str, offset: int = 0, length: int | None = None) -> Source:
    """A Source for the archive at bytes [offset, offset + length) of `path` (default: the whole
    file), which must be a regular file inside `folder` (a local path or a URL)."""
    reader, size = files.open_inside(path, folder)
    length = size - offset if length is None else length
    if offset < 0 or length < 0 or offset + length > size:
        reader.close()
        raise CheckpointError(path, f"bytes {offset}+{length} lie past its end ({size} bytes)")
    return Source(path, reader, offset, length)


def load_lazy(path: str, folder: str | None = None, lazy_bytes: int | None = None) -> Any:
    """torch_pickle.load_pt, but big tensors are LazyTensors read by range; files in torch's
    legacy (non-zip) format are read whole through load_pt."""
    from zeroshard.interop.torch_pickle import load_pt

    folder = folder or files.parent(path)
    src = open_archive(path, folder)
    if not is_zip(src):
        del src
        return load_pt(path, folder)
    return load(src, lazy_bytes)
