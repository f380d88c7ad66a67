"""An output rank file's hashes, taken while its bytes are copied, as long as they come in order.

A 1.1 rank file records a hash per tensor (its hash table) and the manifest one for the whole
file. Reading every finished output again to compute them costs a pass over all the bytes
written. Most reshards write each output tensor front to back, and many write whole outputs
front to back (4 -> 16: every output comes from one input), so the hashes can ride on the copy,
over bytes still in the CPU's cache. A write that is not where a hash expects its next bytes
simply leaves that hash unfinished; only unfinished hashes are computed from the finished file.

Sound because the copy writes every byte of an output exactly once: a hash that saw its region
from the first byte to the last, in order, saw exactly the bytes the file holds.
"""

from __future__ import annotations

from typing import Sequence

from zeroshard.storage.hashing import new_hasher


class InOrderHashes:
    """Hashes of one output: one per region (its tensors, back to back after the header) and
    one of the file, each kept while the bytes fed to it arrive in order."""

    def __init__(self, header: bytes, regions: Sequence[tuple[int, int]]):
        self._file = new_hasher()
        self._file.update(header)
        self._file_at: int | None = len(header)
        self._regions = list(regions)
        self._hashers = [new_hasher() for _ in self._regions]
        self._digests: list[str | None] = [None] * len(self._regions)
        self._expecting: dict[int, int] = {}  # next byte offset a region's hash waits for -> region
        for i, (begin, end) in enumerate(self._regions):
            if end > begin:
                self._expecting[begin] = i
            else:
                self._digests[i] = self._hashers[i].hexdigest()

    def feed(self, at: int, data: memoryview) -> None:
        """`data` was just written at byte `at` of the output, inside one region."""
        n = len(data)
        if self._file_at is not None:
            if at == self._file_at:
                self._file.update(data)
                self._file_at += n
            else:
                self._file_at = None  # out of order: the file hash is computed from the file
        i = self._expecting.pop(at, None)
        if i is None:
            return  # this region's hash already missed bytes (or never will complete)
        self._hashers[i].update(data)
        end = self._regions[i][1]
        if at + n < end:
            self._expecting[at + n] = i
        elif at + n == end:
            self._digests[i] = self._hashers[i].hexdigest()

    def region_hash(self, i: int) -> str | None:
        """Region i's hash, or None where its bytes did not all come in order."""
        return self._digests[i]

    def file_hash(self, tail_at: int, tail: bytes) -> str | None:
        """The file hash with `tail` (bytes written last, at `tail_at`) appended; None where the
        bytes before it did not all come in order."""
        if self._file_at != tail_at:
            return None
        self._file.update(tail)
        self._file_at = None
        return self._file.hexdigest()
