"""Write a safetensors file front to back without holding its tensors: header first (computed
from names, dtypes and shapes), then the data bytes in order, hashed on the way out.

The caller streams bytes with `write()`; the file and every tensor are hashed in the same pass.
The file is committed atomically on a clean exit, and only if exactly the announced bytes were
written.
"""

from __future__ import annotations

from typing import Sequence

from zeroshard.errors import StorageError
from zeroshard.storage.hashing import SegmentHasher
from zeroshard.storage.location import AtomicWriter, Location
from zeroshard.storage.safetensors_header import build_header

SMALL_WRITE_BYTES = 64 * 1024
GATHER_BYTES = 1024 * 1024


class SafetensorsStreamWriter:
    """`with SafetensorsStreamWriter(loc, name, tensors, metadata) as w: w.write(bytes)...`

    After the block: `size`, `file_hash` and `tensor_hashes` (name -> hex) describe the file.
    write_behind: see AtomicWriter, and [Note: write-behind buffers]: a write of at least
    SMALL_WRITE_BYTES goes to the writer thread and its data must stay unchanged until the next
    such write returns (or the block ends). Smaller writes are copied into a gather buffer and
    release nothing, so two alternating buffers are safe only when every write from them is that
    large: a caller that reuses buffers hands smaller pieces over as fresh copies
    (checkpointing.staging does). A small piece in a reused buffer once let the next one overwrite
    a write still in flight: a GPU save failed its own hash check (CHANGELOG, Fixed).
    """

    def __init__(self, location: Location, name: str, tensors: Sequence[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str], durable: bool = True, write_behind: bool = False):
        self.where = location.url_of(name)
        self._header, entries = build_header(list(tensors), metadata)
        self.size = max((e.end for e in entries.values()), default=len(self._header))
        self._hasher = SegmentHasher([(e.begin, e.end, n) for n, e in entries.items()])
        self._out = AtomicWriter(location, name, durable, write_behind)
        self._small = bytearray()  # small writes gathered: a syscall (or thread hand-off) per fragment is the cost
        self.file_hash = ""
        self.tensor_hashes: dict[str, str] = {}

    def __enter__(self) -> "SafetensorsStreamWriter":
        self._out.__enter__()
        try:
            self._write(memoryview(self._header))
        except BaseException as exc:
            self._out.__exit__(type(exc), exc, None)
            raise
        return self

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append the next bytes of tensor data (may span tensor boundaries)."""
        view = memoryview(data).cast("B")
        if self._hasher.offset + len(view) > self.size:
            raise StorageError(self.where, f"writer bug: {self._hasher.offset + len(view)} bytes written "
                                           f"into a {self.size}-byte file")
        self._write(view)

    def segment_hash(self, name: str) -> str:
        """The hash of tensor `name`, available as soon as its last byte was written."""
        return self._hasher.segment_hashes[name]

    def _write(self, view: memoryview) -> None:
        self._hasher.update(view)
        if len(view) < SMALL_WRITE_BYTES:
            self._small += view
            if len(self._small) >= GATHER_BYTES:
                self._flush_small()
            return
        self._flush_small()
        self._out.write(view)

    def _flush_small(self) -> None:
        if self._small:
            self._out.write(bytes(self._small))  # a copy: write-behind may still be sending it
            self._small.clear()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            try:
                self._flush_small()
            except BaseException as error:
                self._out.__exit__(type(error), error, tb)
                raise
        if exc_type is None and self._hasher.offset != self.size:
            error = StorageError(self.where, f"incomplete: {self._hasher.offset} of {self.size} bytes written")
            self._out.__exit__(StorageError, error, tb)
            raise error
        self.file_hash = self._hasher.hexdigest
        self.tensor_hashes = dict(self._hasher.segment_hashes)
        self._out.__exit__(exc_type, exc, tb)
