"""Writing checkpoints: which fragments each rank's file holds, the files themselves, the manifest.

Used by the toolkit (shard, reshard) and by the training core's save alike, so there is one
writer of the format. A rank file is streamed: the caller's `fill` callback produces the bytes
of each fragment in file order, the writer hashes them on the way out and appends the file's
fragment-hash table (format 1.1) as its last tensor.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable, Sequence

from zeroshard.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HASH_TABLE_NAME,
    FileEntry,
    Manifest,
    TensorEntry,
    rank_file_name,
)
from zeroshard.storage.location import Location
from zeroshard.storage.stream_writer import SafetensorsStreamWriter

# A tensor to be stored, before any file exists: the same description the manifest keeps.
TensorSpec = TensorEntry


def rank_metadata(checkpoint_id: str, rank: int, world_size: int) -> dict[str, str]:
    """The `__metadata__` of a rank file: enough to tell what it is with plain safetensors."""
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "checkpoint_id": checkpoint_id,
            "rank": str(rank), "world_size": str(world_size)}


def rank_file_layout(contents: Sequence[tuple[TensorSpec, int, int]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors of a 1.1 rank file in order: its fragments, then the fragment-hash table."""
    layout = [(spec.name, spec.dtype, (end - start,)) for spec, start, end in contents]
    layout.append((HASH_TABLE_NAME, "U64", (len(contents),)))
    return layout


def hash_table_bytes(hashes: Sequence[str]) -> bytes:
    """The hash table's data: each fragment's XXH3-64 as a little-endian u64, in file order."""
    return struct.pack(f"<{len(hashes)}Q", *(int(h, 16) for h in hashes))


def parse_hash_table(data: bytes | memoryview) -> list[str]:
    """hash_table_bytes' inverse: the 16-hex-digit hashes, in file order."""
    return [f"{v:016x}" for v in struct.unpack(f"<{len(data) // 8}Q", data)]


@dataclass
class RankFileResult:
    file: FileEntry
    fragment_hashes: dict[str, str]  # tensor name -> hash of the fragment this file holds


Fill = Callable[[TensorSpec, int, int, Callable[[memoryview], None]], None]


def write_rank_file(location: Location, checkpoint_id: str, rank: int, world_size: int,
                    contents: Sequence[tuple[TensorSpec, int, int]], fill: Fill, durable: bool = True,
                    write_behind: bool = False) -> RankFileResult:
    """Stream one rank's file; `fill(spec, start, end, write)` must write exactly the bytes of
    elements [start, end) of `spec`, in order.

    A training rank writes its own file durably (fsync before rename). A single process writing
    every rank's file may pass durable=False and have commit_checkpoint(sync_files=True) sync
    them all at once before the manifest vouches for them. write_behind: see AtomicWriter.
    """
    name = rank_file_name(rank, world_size)
    with SafetensorsStreamWriter(location, name, rank_file_layout(contents),
                                 rank_metadata(checkpoint_id, rank, world_size), durable, write_behind) as out:
        for spec, start, end in contents:
            fill(spec, start, end, out.write)
        hashes = [out.segment_hash(spec.name) for spec, _, _ in contents]
        out.write(hash_table_bytes(hashes))
    return RankFileResult(FileEntry(name, rank, out.size, out.file_hash),
                          {spec.name: h for (spec, _, _), h in zip(contents, hashes)})


def build_manifest(specs: Sequence[TensorSpec], world_size: int, results: Sequence[RankFileResult],
                   checkpoint_id: str, **fields: object) -> Manifest:
    """The manifest describing `results` (one per rank); `fields` are Manifest's optional fields."""
    files = sorted((r.file for r in results), key=lambda f: f.rank)
    return Manifest(world_size=world_size, tensors={s.name: s for s in specs}, files=files, id=checkpoint_id,
                    **fields)  # type: ignore[arg-type]
