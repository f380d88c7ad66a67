"""Every rank file of a checkpoint, described without a loop over tensors x ranks.

Rank files differ little: at a world size W, a flat tensor of n elements gives every rank below
n // c the same c elements (c = ceil(n / W)), one rank the remainder and the rest nothing. So the
ranks fall into runs of consecutive ranks whose files hold the same tensors with the same shapes
(one run, or a handful, in practice), and within a run the headers differ only in the rank
number in `__metadata__`. This module computes each run's layout once (O(tensors) per run, at
most min(W, 2 x tensors + 3) runs) and gives, per rank, the exact header bytes a zeroshard
writer puts there, the file size and every tensor's byte range as arrays indexed by tensor.

Used by verify (a header is checked with one comparison) and by the packed copy of many small
files (zeroshard.toolkit.packed), which plans and writes 1,000 rank files at numpy speed. No numpy here: verify starts faster without it.
"""

from __future__ import annotations

import bisect
import json
import struct
from dataclasses import dataclass
from typing import Sequence

from zeroshard.format.manifest import FORMAT_NAME, HASH_TABLE_NAME, TensorEntry, rank_contents
from zeroshard.storage.safetensors_header import build_header_bytes

_PREFIX = b'{"__metadata__":'


@dataclass
class Run:
    """Ranks [first, end) whose files hold the same tensors with the same shapes."""

    first: int
    end: int
    tensors: list[int]  # indices (into RankLayouts.tensors) of the fragments, in file order
    begin: list[int]  # each fragment's byte offset from the start of the data section (same order)
    nbytes: list[int]  # each fragment's bytes
    table_begin: int  # the hash table's offset from the start of the data section (-1: no table)
    data_bytes: int  # the data section's size, table included
    tail: bytes  # the header JSON after the metadata: `,<tensors>}` (padding not included)
    arrays: tuple | None = None  # the three lists above as arrays, made by whoever needs them


class RankLayouts:
    """The files of `tensors` at `world_size`, for a checkpoint `checkpoint_id` of `version`.

    `hash_table`: the files end with the fragment-hash table (format 1.1; 1.0 files do not).
    """

    def __init__(self, tensors: Sequence[TensorEntry], world_size: int, checkpoint_id: str, version: str,
                 hash_table: bool = True):
        self.tensors = list(tensors)
        self.index = {t.name: i for i, t in enumerate(self.tensors)}
        self.world_size, self.checkpoint_id, self.version = world_size, checkpoint_id, version
        self.hash_table = hash_table
        breaks = {0, world_size}
        for t in self.tensors:
            n = t.numel
            if t.layout == "flat":
                if n:
                    c = -(-n // world_size)
                    breaks.update((n // c, -(-n // c)))
            elif n:
                holder = t.owner if t.layout == "local" else 0
                breaks.update((holder, holder + 1))
        self.starts = sorted(b for b in breaks if 0 <= b <= world_size)[:-1]
        # the metadata's JSON differs between ranks only in the rank: split it there, once
        left, mark, right = _metadata_json(self.metadata(0)).partition(b'"rank":"0"')
        self._meta = (left + b'"rank":"', b'"' + right) if mark and mark not in right else None
        self.runs = [self._run(first, end) for first, end in zip(self.starts, self.starts[1:] + [world_size])]

    def _run(self, first: int, end: int) -> Run:
        contents = rank_contents(self.tensors, self.world_size, first)
        layout = [(t.name, t.dtype, (e - s,)) for t, s, e in contents]
        if self.hash_table:
            layout.append((HASH_TABLE_NAME, "U64", (len(contents),)))
        metadata = self.metadata(first)
        raw, relative = build_header_bytes(layout, metadata)
        text = raw[8:].rstrip(b" ")
        head = _PREFIX + _metadata_json(metadata)
        if not text.startswith(head):  # build_header_bytes composes differently: this module must follow
            raise AssertionError("rank header layout changed; update zeroshard.toolkit.layouts")
        order = [self.index[t.name] for t, _, _ in contents]
        begin = [relative[t.name][2] for t, _, _ in contents]
        nbytes = [relative[t.name][3] - relative[t.name][2] for t, _, _ in contents]
        table_begin = relative[HASH_TABLE_NAME][2] if self.hash_table else -1
        data_bytes = max((r[3] for r in relative.values()), default=0)
        return Run(first, end, order, begin, nbytes, table_begin, data_bytes, text[len(head):])

    def metadata(self, rank: int) -> dict[str, str]:
        """A rank file's `__metadata__` (zeroshard.format.writer.rank_metadata, for `version`)."""
        return {"format": FORMAT_NAME, "format_version": self.version, "checkpoint_id": self.checkpoint_id,
                "rank": str(rank), "world_size": str(self.world_size)}

    def run_of(self, rank: int) -> Run:
        return self.runs[bisect.bisect_right(self.starts, rank) - 1]

    def header(self, rank: int) -> bytes:
        """The exact header bytes (length prefix included) of `rank`'s file."""
        if self._meta is not None:
            meta = self._meta[0] + str(rank).encode() + self._meta[1]
        else:
            meta = _metadata_json(self.metadata(rank))
        text = _PREFIX + meta + self.run_of(rank).tail
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    def file_size(self, rank: int, header: bytes | None = None) -> int:
        return len(header if header is not None else self.header(rank)) + self.run_of(rank).data_bytes


def _metadata_json(metadata: dict[str, str]) -> bytes:
    return json.dumps(metadata, separators=(",", ":")).encode()


def layouts_of(manifest) -> RankLayouts:
    """The files of a parsed manifest, as they are on disk (1.0 files have no hash table)."""
    return RankLayouts(list(manifest.tensors.values()), manifest.world_size, manifest.id, manifest.version,
                       hash_table=manifest.legacy_hashes is None)
