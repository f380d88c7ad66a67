"""Storage: fsspec locations with ranged reads and atomic writes, safetensors headers, hashing.

Knows nothing of checkpoints or training; the format and both halves build on it.
"""

from zeroshard.storage.hashing import HASH_ALGORITHM, SegmentHasher, new_hasher
from zeroshard.storage.location import AtomicWriter, Location, RangeReader, parse_storage_options, storage_errors
from zeroshard.storage.safetensors_header import (
    DTYPE_SIZES,
    Header,
    HeaderEntry,
    build_header,
    dtype_name,
    read_header,
    torch_dtype,
)
from zeroshard.storage.stream_writer import SafetensorsStreamWriter

__all__ = [
    "AtomicWriter", "DTYPE_SIZES", "HASH_ALGORITHM", "Header", "HeaderEntry", "Location", "RangeReader",
    "SafetensorsStreamWriter", "SegmentHasher", "build_header", "dtype_name", "new_hasher", "parse_storage_options",
    "read_header", "storage_errors", "torch_dtype",
]
