"""safetensors headers, read and written without the tensor data.

A safetensors file is: 8 bytes little-endian u64 N, then N bytes of JSON (padded with spaces to
a multiple of 8), then the data. The JSON maps each tensor name to {"dtype", "shape",
"data_offsets": [begin, end]} relative to the start of the data, plus an optional
"__metadata__" of string to string. Parsing here validates everything a reader relies on, so
a corrupt header is a one-line error, not a crash later.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from zeroshard.errors import CheckpointError, InvalidArgumentError
from zeroshard.storage.location import RangeReader

if TYPE_CHECKING:
    import torch

# Headers above this are refused as corrupt: real ones are ~100 bytes per tensor.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "C64": 8, "F8_E8M0": 1,
}

# torch is imported only when a dtype is converted: the toolkit's byte-copying paths never
# need it, and importing it costs ~1.7 s of start-up per command.
_TORCH_ATTRS = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64", "F8_E8M0": "float8_e8m0fnu",
}


def dtype_name(dtype: "torch.dtype") -> str:
    """The safetensors name of a torch dtype ("F32", "BF16", ...)."""
    attr = str(dtype).removeprefix("torch.")
    for name, candidate in _TORCH_ATTRS.items():
        if candidate == attr:
            return name
    raise InvalidArgumentError(f"dtype {dtype} has no safetensors equivalent")


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    try:
        return getattr(torch, _TORCH_ATTRS[name])
    except (KeyError, AttributeError):
        raise InvalidArgumentError(f"unknown safetensors dtype {name!r}") from None


class HeaderEntry(NamedTuple):  # a tuple: headers of 1,000 rank files hold 300,000 of these
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset from the start of the file (not of the data section)
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int  # 8 + header length
    file_size: int  # what the header implies: data_start + end of the last tensor


@functools.lru_cache(maxsize=65536)
def _entry_prefix(name: str, dtype: str) -> str:
    return f'{json.dumps(name)}:{{"dtype":"{dtype}","shape":['  # the same names recur in every rank file


def build_header(tensors: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str]) -> tuple[bytes, dict[str, HeaderEntry]]:
    """The header bytes for tensors laid out back to back in the given order.

    Returns the bytes (length prefix included) and each tensor's absolute byte range.
    """
    header, relative = build_header_bytes(tensors, metadata)
    data_start = len(header)
    entries = {n: HeaderEntry(d, s, data_start + b, data_start + e) for n, (d, s, b, e) in relative.items()}
    return header, entries


def build_header_bytes(tensors: list[tuple[str, str, tuple[int, ...]]],
                       metadata: dict[str, str]) -> tuple[bytes, dict[str, tuple[str, tuple[int, ...], int, int]]]:
    """The header bytes, and each tensor's (dtype, shape, begin, end) relative to the data section
    (shared between calls with the same tensors: do not modify it).

    The JSON is composed directly (what json.dumps would write, compactly). The tensors' part is
    remembered for the last few layouts: the rank files of one checkpoint mostly share a layout
    and differ only in their metadata, and a 1,000-rank reshard writes and checks 2,000 headers.
    """
    body, relative = _tensors_json(tuple((name, dtype, tuple(shape)) for name, dtype, shape in tensors))
    head = '"__metadata__":' + json.dumps(metadata, separators=(",", ":")) if metadata else ""
    text = ("{" + head + ("," if head and body else "") + body + "}").encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, relative


@functools.lru_cache(maxsize=16)
def _tensors_json(tensors: tuple[tuple[str, str, tuple[int, ...]], ...]) -> tuple[str, dict[str, tuple]]:
    parts = []
    offset = 0
    relative: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, dtype, shape in tensors:
        if name in relative or name == "__metadata__":
            raise InvalidArgumentError(f"duplicate or reserved tensor name {name!r}")
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        dims = ",".join(map(str, shape)) if len(shape) != 1 else str(shape[0])
        parts.append(f'{_entry_prefix(name, dtype)}{dims}],"data_offsets":[{offset},{offset + nbytes}]}}')
        relative[name] = (dtype, shape, offset, offset + nbytes)
        offset += nbytes
    return ",".join(parts), relative


MAX_DIMS = 64  # far beyond any real tensor; bounds the work a hostile shape can ask for


def _quote(name: str) -> str:
    """A tensor name for a one-line message: at most 80 characters of it."""
    return repr(name[:80]) + ("..." if len(name) > 80 else "")


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json's default keeps the last of two equal keys silently; a header must not be ambiguous."""
    table: dict[str, object] = {}
    for key, value in pairs:
        if key in table:
            raise _DuplicateKey(key)
        table[key] = value
    return table


def parse_header(raw: bytes, where: str, file_size: int | None = None) -> Header:
    """Validate and parse header JSON bytes (without the 8-byte prefix)."""
    try:
        table = json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise CheckpointError(where, f"safetensors header names {_quote(exc.args[0])} twice "
                                     "(which one is the tensor?)") from None
    except RecursionError:
        raise CheckpointError(where, "safetensors header is nested absurdly deep") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(where, f"safetensors header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(table, dict):
        raise CheckpointError(where, "safetensors header is not a JSON object")
    data_start = 8 + len(raw)
    metadata = table.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(where, "safetensors __metadata__ must map strings to strings")
    entries: dict[str, HeaderEntry] = {}
    sizes = DTYPE_SIZES
    for name, info in table.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            numel = 1
            for d in shape:
                if type(d) is not int or d < 0:
                    raise ValueError  # internal: caught two lines below (a bad header entry)
                numel *= d
            ok = dtype in sizes and len(shape) <= MAX_DIMS and type(begin) is int and type(end) is int
            ok = ok and 0 <= begin <= end
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(where, f"safetensors header entry {_quote(name)} is malformed "
                                         "(dtype, shape, data_offsets)")
        if end - begin != numel * sizes[dtype]:
            raise CheckpointError(where, f"tensor {_quote(name)}: byte range does not match its dtype and shape")
        entries[name] = HeaderEntry(dtype, tuple(shape), data_start + begin, data_start + end)
    # Tensors must tile the data section: no overlaps, no gaps (what safetensors itself checks).
    cursor = data_start
    for name, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != cursor:
            raise CheckpointError(where, f"tensor {_quote(name)} does not start where the previous one ends "
                                         "(overlap or gap)")
        cursor = entry.end
    if file_size is not None and cursor != file_size:
        problem = "truncated" if file_size < cursor else "longer than its header says"
        raise CheckpointError(where, f"file is {problem}: header implies {cursor} bytes, file has {file_size}")
    return Header(entries, metadata, data_start, cursor)


def read_header(reader: RangeReader, file_size: int) -> Header:
    """Read and validate the header of an open file of known size."""
    where = reader.where
    if file_size < 8:
        raise CheckpointError(where, f"file is truncated: {file_size} bytes, not even a header length")
    (length,) = struct.unpack("<Q", reader.read(0, 8))
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise CheckpointError(where, f"absurd safetensors header length {length} for a file of {file_size} bytes")
    return parse_header(reader.read(8, length), where, file_size)
