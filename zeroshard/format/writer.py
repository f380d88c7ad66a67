"""Writing checkpoints: which fragments each rank's file holds, the files themselves, the manifest.

Used by the toolkit (shard, reshard) and by the training core's save alike, so there is one
writer of the format. A rank file is streamed: the caller's `fill` callback produces the bytes
of each fragment in file order, and the writer hashes them on the way out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from zeroshard.format.manifest import FORMAT_NAME, FORMAT_VERSION, FileEntry, Fragment, Manifest, TensorEntry, rank_file_name
from zeroshard.partition import shard_range
from zeroshard.storage.location import Location
from zeroshard.storage.safetensors_header import DTYPE_SIZES
from zeroshard.storage.stream_writer import SafetensorsStreamWriter


@dataclass(frozen=True)
class TensorSpec:
    """A global tensor to be stored, before any file exists."""

    name: str
    role: str
    dtype: str
    shape: tuple[int, ...]
    layout: str = "flat"
    param: str | None = None
    state: str | None = None
    owner: int = 0  # the rank holding a 'local' tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @classmethod
    def of(cls, entry: TensorEntry) -> "TensorSpec":
        owner = entry.fragments[0].rank if entry.layout == "local" and entry.fragments else 0
        return cls(entry.name, entry.role, entry.dtype, entry.shape, entry.layout, entry.param, entry.state, owner)


def owned_range(spec: TensorSpec, world_size: int, rank: int) -> tuple[int, int]:
    """Elements of `spec` that `rank`'s file holds under the format's layout rules."""
    if spec.layout == "flat":
        return shard_range(spec.numel, world_size, rank)
    holder = spec.owner if spec.layout == "local" else 0
    return (0, spec.numel) if rank == holder else (0, 0)


def rank_contents(specs: Iterable[TensorSpec], world_size: int, rank: int) -> list[tuple[TensorSpec, int, int]]:
    """(tensor, start, end) for every non-empty fragment of `rank`'s file, in file order."""
    out = []
    for spec in specs:
        start, end = owned_range(spec, world_size, rank)
        if end > start:
            out.append((spec, start, end))
    return out


def rank_metadata(checkpoint_id: str, rank: int, world_size: int) -> dict[str, str]:
    """The `__metadata__` of a rank file: enough to tell what it is with plain safetensors."""
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "checkpoint_id": checkpoint_id,
            "rank": str(rank), "world_size": str(world_size)}


@dataclass
class RankFileResult:
    file: FileEntry
    fragments: dict[str, Fragment]  # tensor name -> the fragment this file holds


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
    layout = [(spec.name, spec.dtype, (end - start,)) for spec, start, end in contents]
    with SafetensorsStreamWriter(location, name, layout, rank_metadata(checkpoint_id, rank, world_size), durable,
                                 write_behind) as out:
        for spec, start, end in contents:
            fill(spec, start, end, out.write)
    fragments = {spec.name: Fragment(rank, start, end, out.tensor_hashes[spec.name]) for spec, start, end in contents}
    return RankFileResult(FileEntry(name, rank, out.size, out.file_hash), fragments)


def build_manifest(specs: Sequence[TensorSpec], world_size: int, results: Sequence[RankFileResult],
                   checkpoint_id: str, **fields: object) -> Manifest:
    """The manifest describing `results` (one per rank); `fields` are Manifest's optional fields."""
    tensors: dict[str, TensorEntry] = {}
    by_rank = sorted(results, key=lambda r: r.file.rank)
    for spec in specs:
        fragments = [r.fragments[spec.name] for r in by_rank if spec.name in r.fragments]
        tensors[spec.name] = TensorEntry(spec.name, spec.role, spec.dtype, spec.shape, spec.layout,
                                         fragments, spec.param, spec.state)
    return Manifest(world_size=world_size, tensors=tensors, files=[r.file for r in by_rank], id=checkpoint_id,
                    **fields)  # type: ignore[arg-type]
