"""Planning a copy: every output file's header, size and tensors, and how the work splits into
tasks. Pure arithmetic over the manifest, no I/O (zeroshard.toolkit.transfer runs the tasks; a
Job is what it is given, Finished what each task returns)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from zeroshard.format.layouts import RankLayouts
from zeroshard.format.manifest import HASH_TABLE_NAME, Manifest, TensorEntry, rank_contents, rank_file_name
from zeroshard.format.writer import FORMAT_VERSION, rank_metadata
from zeroshard.storage.safetensors_header import DTYPE_SIZES, build_header_bytes


def carried_tensors(manifest: Manifest, world_size: int) -> list[TensorEntry]:
    """What a reshard to `world_size` writes: every tensor but the per-rank ('local') ones such
    as RNG states, which mean nothing at another world size (kept at the same one)."""
    return [t for t in manifest.tensors.values() if world_size == manifest.world_size or t.layout != "local"]


class OutTensor(NamedTuple):
    """Elements [start, end) of global tensor `source`, stored in an output file under `name` with
    `shape` and `dtype`, from byte `begin` (filled in by plan_output). A tuple: a reshard to
    1,000 ranks plans 300,000 of them."""

    name: str
    source: TensorEntry
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]
    begin: int = 0

    @property
    def nbytes(self) -> int:
        return (self.end - self.start) * DTYPE_SIZES[self.dtype]


@dataclass
class OutputPlan:
    """One output file: its header bytes (length prefix included), its tensors, its size."""

    name: str
    header: bytes
    tensors: list[OutTensor]
    size: int
    hash_table: bool  # a 1.1 rank file: ends with the fragment-hash table, file hash recorded


def plan_output(name: str, tensors: Sequence[tuple[str, TensorEntry, int, int, str, tuple[int, ...]]],
                metadata: dict[str, str], hash_table: bool) -> OutputPlan:
    """Lay (name, source, start, end, dtype, shape) tensors out back to back, plus the
    fragment-hash table for a rank file."""
    layout = [(t[0], t[4], t[5]) for t in tensors]
    if hash_table:
        layout.append((HASH_TABLE_NAME, "U64", (len(tensors),)))
    header, relative = build_header_bytes(layout, metadata)
    start = len(header)
    placed = [OutTensor(*t, start + relative[t[0]][2]) for t in tensors]
    size = start + max((r[3] for r in relative.values()), default=0)
    return OutputPlan(name, header, placed, size, hash_table)


class FixedPlans:
    """Outputs planned up front (consolidate: one model file, or a few HF shards)."""

    def __init__(self, plans: list[OutputPlan]):
        self.plans = plans
        self.count = len(plans)

    def plan(self, index: int) -> OutputPlan:
        return self.plans[index]

    def name(self, index: int) -> str:
        return self.plans[index].name


class RankFilePlans:
    """The rank files of a checkpoint at `world_size`, each planned where it is written: a worker
    plans (and creates) only its own outputs, so planning 1,000 headers is spread too."""

    def __init__(self, tensors: list[TensorEntry], world_size: int, checkpoint_id: str):
        self.tensors, self.world_size, self.checkpoint_id = tensors, world_size, checkpoint_id
        self.count = world_size
        self._layouts: RankLayouts | None = None

    @property
    def layouts(self) -> RankLayouts:
        """Every output's header and fragment offsets, by runs of alike ranks (made on first use)."""
        if self._layouts is None:
            self._layouts = RankLayouts(self.tensors, self.world_size, self.checkpoint_id, FORMAT_VERSION)
        return self._layouts

    def name(self, rank: int) -> str:
        return rank_file_name(rank, self.world_size)

    def plan(self, rank: int) -> OutputPlan:
        return plan_output(rank_file_name(rank, self.world_size),
                           [(t.name, t, start, end, t.dtype, (end - start,))
                            for t, start, end in rank_contents(self.tensors, self.world_size, rank)],
                           rank_metadata(self.checkpoint_id, rank, self.world_size), hash_table=True)


@dataclass
class Task:
    """Fill some outputs: whole ones, then finished here (hash table and hashes), or those the
    caller created up front (Job.temp_paths), with the pieces of `plan` only."""

    outputs: list[int]
    plan: Any = None  # the pieces (a zeroshard.toolkit.plan.Plan); None: whole rank files, planned by the task


PIECE_BUDGET = 500_000  # pieces per task: bounds what a task holds per piece (~100 bytes each); a task of a
# consolidate reads every input, so 1,000 ranks x 300 tensors is one task, not two reading each input
# output bytes per task of small outputs: bounds a packed task's buffers (zeroshard.toolkit.packed);
# big outputs are grouped by pieces only (their copies go through bounded windows anyway)
TASK_BYTES = 32 * 1024 * 1024


@dataclass
class Finished:
    """An output written completely under `temp_path`, ready to be moved to `name`."""

    name: str
    temp_path: str
    size: int
    file_hash: str = ""


@dataclass
class Job:
    """Everything a worker needs, picklable: where to read, what to write."""

    source_url: str
    storage_options: dict
    manifest: Manifest
    target_url: str
    planner: FixedPlans | RankFilePlans
    temp_paths: dict[int, str] = field(default_factory=dict)  # outputs created up front (split tasks)
    verify_hashes: bool = True
