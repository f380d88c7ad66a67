"""Every rank file of a checkpoint, described without a loop over tensors x ranks.

Rank files differ little: at a world size W, a flat tensor of n elements gives every rank below
n // c the same c elements (c = ceil(n / W)), one rank the remainder and the rest nothing. So the
ranks fall into runs of consecutive ranks whose files hold the same tensors with the same shapes
(one run, or a handful, in practice), and within a run the headers differ only in the rank
number in `__metadata__`. This module computes each run's layout once (O(tensors) per run, at
most min(W, 2 x tensors + 3) runs) and gives, per rank, the exact header bytes a zeroshard
writer puts there, the file size and every tensor's byte range as arrays indexed by tensor.

Used by CheckpointReader and verify (a header is checked with one comparison) and by the packed
copy of many small files (zeroshard.toolkit.packed), which plans and writes 1,000 rank files at
numpy speed. No numpy here: verify starts faster without it.
"""

from __future__ import annotations

import bisect
import json
import struct
from dataclasses import dataclass
from typing import Sequence

from zeroshard.format.manifest import FORMAT_NAME, HASH_TABLE_NAME, TensorEntry, rank_contents
from zeroshard.partition import owning_ranks
from zeroshard.storage.safetensors_header import Header, HeaderEntry, build_header_bytes

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
    body: bytes | None = None  # the fragments' JSON entries, table excluded (for ranks with per-rank tensors)


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
        # Per-rank ('local') tensors listed after all others (as training saves RNG states) are
        # kept out of the runs, else every rank would be a run of its own: each rank's are added
        # to its run's layout (rank_layout). Listed elsewhere, they split the runs instead.
        base = len(self.tensors)
        while base and self.tensors[base - 1].layout == "local":
            base -= 1
        if any(t.layout == "local" for t in self.tensors[:base]):
            base = len(self.tensors)
        self._base = base
        self._extras: dict[int, list[int]] = {}
        for i in range(base, len(self.tensors)):
            if self.tensors[i].numel:
                self._extras.setdefault(self.tensors[i].owner, []).append(i)
        breaks = {0, world_size}
        for t in self.tensors[:base]:
            n = t.numel
            if t.layout == "flat":
                breaks.update(owning_ranks(n, world_size))
            elif n:
                holder = t.owner if t.layout == "local" else 0
                breaks.update((holder, holder + 1))
        self.starts = sorted(b for b in breaks if 0 <= b <= world_size)[:-1]
        # the metadata's JSON differs between ranks only in the rank: split it there, once
        left, mark, right = _metadata_json(self.metadata(0)).partition(b'"rank":"0"')
        self._meta = (left + b'"rank":"', b'"' + right) if mark and mark not in right else None
        self._runs: list[Run | None] = [None] * len(self.starts)  # each made on first use
        self._last: tuple[int, Run] | None = None
        self._entries: dict[tuple[int, int, int], dict[str, HeaderEntry]] = {}  # shared by alike ranks: read only
        if self._extras and not self._extras_compose_right():
            self._split_per_rank()

    def _split_per_rank(self) -> None:
        """The safe layout: per-rank tensors split the runs (never expected to be needed)."""
        self._base, self._extras = len(self.tensors), {}
        breaks = set(self.starts) | {self.world_size}
        for t in self.tensors:
            if t.layout == "local" and t.numel:
                breaks.update((t.owner, t.owner + 1))
        self.starts = sorted(b for b in breaks if 0 <= b <= self.world_size)[:-1]
        self._runs = [None] * len(self.starts)  # each made on first use

    def _extras_compose_right(self) -> bool:
        """Check rank_layout's composition against the writer's, on one rank, once."""
        rank = min(self._extras)
        layout = [(t.name, t.dtype, (e - s,)) for t, s, e in rank_contents(self.tensors, self.world_size, rank)]
        if self.hash_table:
            layout.append((HASH_TABLE_NAME, "U64", (len(layout),)))
        raw, _ = build_header_bytes(layout, self.metadata(rank))
        return raw == self.header(rank)

    def _run(self, first: int, end: int) -> Run:
        contents = rank_contents(self.tensors[:self._base], self.world_size, first)
        layout = [(t.name, t.dtype, (e - s,)) for t, s, e in contents]
        if self.hash_table:
            layout.append((HASH_TABLE_NAME, "U64", (len(contents),)))
        metadata = self.metadata(first)
        raw, relative = build_header_bytes(layout, metadata)
        text = raw[8:].rstrip(b" ")
        head = _PREFIX + _metadata_json(metadata)
        if not text.startswith(head):  # build_header_bytes composes differently: this module must follow
            raise AssertionError("rank header layout changed; update zeroshard.format.layouts")  # internal: code drift
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

    @property
    def runs(self) -> list[Run]:
        """Every run. Each costs O(tensors) to make; a reader of a few files makes only theirs."""
        return [self._run_at(i) for i in range(len(self.starts))]

    def _run_at(self, i: int) -> Run:
        run = self._runs[i]
        if run is None:
            end = self.starts[i + 1] if i + 1 < len(self.starts) else self.world_size
            run = self._runs[i] = self._run(self.starts[i], end)
        return run

    def run_of(self, rank: int) -> Run:
        """The run `rank` belongs to (its per-rank tensors not included: see rank_layout)."""
        return self._run_at(bisect.bisect_right(self.starts, rank) - 1)

    def rank_layout(self, rank: int) -> Run:
        """What `rank`'s file holds: its run, plus its per-rank tensors when it has any."""
        run = self.run_of(rank)
        extras = self._extras.get(rank)
        if not extras:
            return run
        last = self._last  # read once: threads of one copy may share this object (layouts_of)
        if last is not None and last[0] == rank:
            return last[1]
        if run.body is None:
            layout = [(self.tensors[i].name, self.tensors[i].dtype, (n // self.tensors[i].itemsize,))
                      for i, n in zip(run.tensors, run.nbytes)]
            raw, _ = build_header_bytes(layout, {})
            run.body = raw[8:].rstrip(b" ")[1:-1]
        offset = run.table_begin if self.hash_table else run.data_bytes
        tensors, begin, nbytes = list(run.tensors), list(run.begin), list(run.nbytes)
        parts = [run.body] if run.body else []
        for i in extras:
            t = self.tensors[i]
            parts.append(_entry(t.name, t.dtype, t.numel, offset, offset + t.nbytes))
            tensors.append(i)
            begin.append(offset)
            nbytes.append(t.nbytes)
            offset += t.nbytes
        table_begin = -1
        if self.hash_table:
            table_begin = offset
            parts.append(_entry(HASH_TABLE_NAME, "U64", len(tensors), offset, offset + 8 * len(tensors)))
            offset += 8 * len(tensors)
        tail = (b"," + b",".join(parts) if parts else b"") + b"}"
        extended = Run(rank, rank + 1, tensors, begin, nbytes, table_begin, offset, tail)
        self._last = (rank, extended)
        return extended

    def header(self, rank: int) -> bytes:
        """The exact header bytes (length prefix included) of `rank`'s file."""
        if self._meta is not None:
            meta = self._meta[0] + str(rank).encode() + self._meta[1]
        else:
            meta = _metadata_json(self.metadata(rank))
        text = _PREFIX + meta + self.rank_layout(rank).tail
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text

    def header_length(self, rank: int) -> int:
        """len(header(rank)), without composing it: where a plan needs only where data begins."""
        if self._meta is None:
            return len(self.header(rank))
        left, right = self._meta
        text = len(_PREFIX) + len(left) + len(str(rank)) + len(right) + len(self.rank_layout(rank).tail)
        return 8 + text + (-text % 8)

    def expected(self, rank: int) -> tuple[bytes, Header]:
        """`rank`'s exact header bytes and what they say. Ranks of one run whose headers have
        one length (rank numbers of as many digits) share one entries dict, made once: reading
        the headers of 1,000 files does not loop over their tensors."""
        raw = self.header(rank)
        layout = self.rank_layout(rank)
        key = (layout.first, layout.end, len(raw))
        entries = self._entries.get(key) if layout.end - layout.first > 1 else None
        if entries is None:
            start = len(raw)
            entries = {}
            for i, begin, nbytes in zip(layout.tensors, layout.begin, layout.nbytes):
                t = self.tensors[i]
                entries[t.name] = HeaderEntry(t.dtype, (nbytes // t.itemsize,), start + begin, start + begin + nbytes)
            if layout.table_begin >= 0:
                begin = start + layout.table_begin
                entries[HASH_TABLE_NAME] = HeaderEntry("U64", (len(layout.tensors),), begin,
                                                       begin + 8 * len(layout.tensors))
            if layout.end - layout.first > 1:
                self._entries[key] = entries
        return raw, Header(entries, self.metadata(rank), len(raw), len(raw) + layout.data_bytes)

    def file_size(self, rank: int, header: bytes | None = None) -> int:
        length = len(header) if header is not None else self.header_length(rank)
        return length + self.rank_layout(rank).data_bytes


def _entry(name: str, dtype: str, numel: int, begin: int, end: int) -> bytes:
    """One 1-D tensor's header entry, as zeroshard.storage.safetensors_header composes it."""
    return (f'{json.dumps(name)}:{{"dtype":"{dtype}","shape":[{numel}],"data_offsets":[{begin},{end}]}}').encode()


def _metadata_json(metadata: dict[str, str]) -> bytes:
    return json.dumps(metadata, separators=(",", ":")).encode()


_last_made: tuple = (None, None)  # the last manifest given and its layouts, replaced whole (threads)


def layouts_of(manifest) -> RankLayouts:
    """The files of a parsed manifest, as they are on disk (1.0 files have no hash table). The
    last manifest's are kept, so a copy's planner and its reader compose each run once."""
    global _last_made
    made = _last_made
    if made[0] is manifest:
        return made[1]
    layouts = RankLayouts(list(manifest.tensors.values()), manifest.world_size, manifest.id, manifest.version,
                          hash_table=manifest.legacy_hashes is None)
    _last_made = (manifest, layouts)
    return layouts
