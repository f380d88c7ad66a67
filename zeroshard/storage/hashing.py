"""The content hash of checkpoint files and fragments: XXH3-64, as 16 hex digits.

Why XXH3: it runs at ~25 GB/s on one core here (sha256: 1.7 GB/s, crc32: 3.8 GB/s), so
hashing every byte written or read costs a few percent of the I/O it rides on. It detects
accidental corruption (bit flips, truncation, stale or mixed-up files); it is not a defence
against a forger, which is not the threat a checkpoint faces.
"""

from __future__ import annotations

import xxhash

HASH_ALGORITHM = "xxh3-64"


def new_hasher() -> "xxhash.xxh3_64":
    return xxhash.xxh3_64()


def hash_bytes(data: bytes | memoryview) -> str:
    """The hash of one buffer, as 16 hex digits (one call: the per-fragment fast path)."""
    return xxhash.xxh3_64_hexdigest(data)


class SegmentHasher:
    """Hashes a byte stream whole and, at the same time, each of its named segments.

    `segments` are (begin, end, name) byte ranges of the stream, sorted and not overlapping;
    bytes outside every segment (a header) count only towards the whole-stream hash.
    """

    def __init__(self, segments: list[tuple[int, int, str]]):
        self._segments = sorted(segments)
        self._whole = new_hasher()
        self._current = new_hasher()
        self._index = 0
        self.offset = 0
        self.segment_hashes: dict[str, str] = {}
        self.update(b"")  # closes empty segments at offset 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._whole.update(view)
        start, stop = self.offset, self.offset + len(view)
        while self._index < len(self._segments):
            begin, end, name = self._segments[self._index]
            lo, hi = max(begin, start), min(end, stop)
            if lo < hi:
                self._current.update(view[lo - start:hi - start])
            if end > stop:
                break
            self.segment_hashes[name] = self._current.hexdigest()
            self._current = new_hasher()
            self._index += 1
        self.offset = stop

    @property
    def hexdigest(self) -> str:
        return self._whole.hexdigest()


def xxh3_int(data: bytes | memoryview) -> int:
    """The hash of one buffer as an integer: the hash-table form, with no hex string made and
    parsed per fragment (a 1,000-rank reshard hashes 300,000 of them)."""
    return xxhash.xxh3_64_intdigest(data)
