"""Rank-major copying: every output file's header and size computed up front, then each input
rank file read once, front to back, each fragment dropped at its computed offsets in the outputs.

This is how reshard and consolidate move bytes into local outputs. The cost is O(bytes + files +
fragments) with one memcpy per piece and no per-fragment open or system call (outputs are
memory-mapped, zeroshard.storage.mapped_file); a 1,024 -> 1,000 reshard of 300 tiny tensors is
about 600,000 pieces, so the per-piece path is kept short. Input fragments are hash-checked as
they are read; 1.1 outputs get their fragment hashes, hash table and file hash in one pass over
each finished file. Work splits by output (whole files, or tensor ranges of one big file) into
tasks that run in this process or in `workers` processes (spawned: no torch, no fork hazards).

Outputs on S3 cannot be written out of order; those are streamed per file instead
(zeroshard.format.writer.write_rank_file fed by CheckpointReader.iter_range).
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from zeroshard.errors import CheckpointError
from zeroshard.format.manifest import HASH_TABLE_NAME, Manifest, TensorEntry
from zeroshard.format.reader import CheckpointReader, fragments_of
from zeroshard.format.writer import hash_table_bytes
from zeroshard.storage.hashing import SegmentHasher, new_hasher
from zeroshard.storage.location import Location
from zeroshard.storage.mapped_file import MappedOutput
from zeroshard.storage.safetensors_header import DTYPE_SIZES, build_header

WINDOW_BYTES = 64 * 1024 * 1024  # how much of one input fragment is mapped (and resident) at a time


@dataclass(frozen=True)
class OutTensor:
    """Elements [start, end) of global tensor `source`, stored in an output file under `name` with
    `shape` and `dtype`, from byte `begin` (filled in by plan_output)."""

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


def plan_output(name: str, tensors: Sequence[OutTensor], metadata: dict[str, str], hash_table: bool) -> OutputPlan:
    """Lay the tensors out back to back (plus the fragment-hash table for a rank file)."""
    layout = [(t.name, t.dtype, t.shape) for t in tensors]
    if hash_table:
        layout.append((HASH_TABLE_NAME, "U64", (len(tensors),)))
    header, entries = build_header(layout, metadata)
    placed = [replace(t, begin=entries[t.name].begin) for t in tensors]
    size = max((e.end for e in entries.values()), default=len(header))
    return OutputPlan(name, header, placed, size, hash_table)


@dataclass
class Task:
    """Fill `tensors` (indices into each output's tensors; None: all) of some outputs; optionally
    finish them (hash table and hashes)."""

    outputs: list[int]
    tensors: dict[int, list[int]] | None = None
    finish: bool = True


@dataclass
class Finished:
    size: int
    file_hash: str
    fragment_hashes: list[str] = field(default_factory=list)


@dataclass
class Job:
    """Everything a worker needs, picklable: where to read, what to write, where the temp files are."""

    source_url: str
    storage_options: dict
    manifest: Manifest
    target_url: str
    plans: list[OutputPlan]
    temp_paths: list[str]
    verify_hashes: bool = True


def run_transfer(job: Job, tasks: list[Task], workers: int = 1,
                 progress: Callable[[int], None] | None = None) -> dict[int, Finished]:
    """Run `tasks` (in this process, or spread over `workers` processes); results of finished outputs."""
    results: dict[int, Finished] = {}
    if workers <= 1 or len(tasks) <= 1:
        for task in tasks:
            results.update(run_task(job, task, progress))
        return results
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(tasks)), mp_context=context) as pool:
        futures = [(pool.submit(run_task, job, task), task) for task in tasks]
        for future, task in futures:
            results.update(future.result())
            if progress is not None:
                progress(_task_bytes(job, task))
    return results


def _task_bytes(job: Job, task: Task) -> int:
    total = 0
    for index in task.outputs:
        tensors = job.plans[index].tensors
        chosen = range(len(tensors)) if task.tensors is None else task.tensors[index]
        total += sum(tensors[i].nbytes for i in chosen)
    return total


def run_task(job: Job, task: Task, progress: Callable[[int], None] | None = None) -> dict[int, Finished]:
    """Fill this task's share of the outputs, reading each needed input file once, in rank order."""
    source = Location(job.source_url, job.storage_options)
    target = Location(job.target_url, job.storage_options)
    outputs = {i: MappedOutput.attach(target, job.plans[i].name, job.temp_paths[i], job.plans[i].size)
               for i in task.outputs}
    try:
        needed = _pieces_by_input(job, task)
        with CheckpointReader(source, job.manifest, verify_hashes=job.verify_hashes) as reader:
            for rank in sorted(needed):
                _copy_from_input(reader, rank, needed[rank], outputs, progress)
                reader.close()  # one input open at a time: its map and descriptor go now
        if not task.finish:
            return {}
        return {i: _finish(job.plans[i], outputs[i]) for i in task.outputs}
    finally:
        for out in outputs.values():
            out.close()


# A piece: (offset in the input fragment, output index, byte offset in the output, elements, output dtype)
Piece = tuple[int, int, int, int, str]


def _pieces_by_input(job: Job, task: Task) -> dict[int, dict[str, list[Piece]]]:
    world = job.manifest.world_size
    needed: dict[int, dict[str, list[Piece]]] = {}
    for index in task.outputs:
        tensors = job.plans[index].tensors
        chosen = range(len(tensors)) if task.tensors is None else task.tensors[index]
        for i in chosen:
            ot = tensors[i]
            out_size = DTYPE_SIZES[ot.dtype]
            for rank, frag_start, frag_end in fragments_of(ot.source, world, ot.start, ot.end):
                lo, hi = max(ot.start, frag_start), min(ot.end, frag_end)
                needed.setdefault(rank, {}).setdefault(ot.source.name, []).append(
                    (lo - frag_start, index, ot.begin + (lo - ot.start) * out_size, hi - lo, ot.dtype))
    return needed


def _copy_from_input(reader: CheckpointReader, rank: int, fragments: dict[str, list[Piece]],
                     outputs: dict[int, MappedOutput], progress: Callable[[int], None] | None) -> None:
    """Read the needed fragments of one input file in file order, each front to back, hash-checked."""
    opened = reader.open_file(rank)
    entries = opened.header.entries
    tensors = reader.manifest.tensors
    window_buffer: memoryview | None = None
    done = 0
    for name in sorted(fragments, key=lambda n: entries[n].begin):
        entry, tensor = entries[name], tensors[name]
        size = tensor.itemsize
        pieces = sorted(fragments[name])
        hasher = new_hasher() if reader.verify_hashes else None
        length = entry.end - entry.begin
        window = max(size, WINDOW_BYTES // size * size)
        for w0 in range(0, length, window):
            wlen = min(window, length - w0)
            view = opened.reader.view(entry.begin + w0, wlen)
            if view is None:  # remote input: read the window into a reused buffer
                if window_buffer is None or len(window_buffer) < wlen:
                    window_buffer = memoryview(bytearray(min(window, max(wlen, 1 << 20))))
                view = window_buffer[:wlen]
                opened.reader.read_into(entry.begin + w0, view)
            if hasher is not None:
                hasher.update(view)
            first, last = w0 // size, (w0 + wlen) // size
            for src, index, dst, count, dtype in pieces:
                lo, hi = max(src, first), min(src + count, last)
                if lo >= hi:
                    continue
                data = view[(lo - first) * size:(hi - first) * size]
                out = outputs[index]
                if dtype != tensor.dtype:
                    data = cast_bytes(data, tensor.dtype, dtype)
                out_size = DTYPE_SIZES[dtype]
                at = dst + (lo - src) * out_size
                out.view[at:at + len(data)] = data
                out.wrote(len(data))
            del view
            opened.reader.release(entry.begin + w0, wlen)
            done += wlen
        if hasher is not None and hasher.hexdigest() != reader.fragment_hash(name, rank):
            raise CheckpointError(reader.where(rank), f"tensor {name!r}: content hash mismatch (file corrupt or modified)")
    if progress is not None:
        progress(done)


def cast_bytes(data: memoryview, src: str, dst: str) -> memoryview:
    """Elements of dtype `src` as dtype `dst` (torch is imported only here, when a cast is asked)."""
    import warnings

    import torch

    from zeroshard.storage.safetensors_header import torch_dtype

    with warnings.catch_warnings():  # a read-only view of the page cache: only read, never written
        warnings.simplefilter("ignore", UserWarning)
        values = torch.frombuffer(data, dtype=torch_dtype(src)).to(torch_dtype(dst))
    return memoryview(values.view(torch.uint8).numpy())


def _finish(plan: OutputPlan, out: MappedOutput) -> Finished:
    """For rank files: the fragment-hash table, and every hash, in one pass over the file."""
    if not plan.hash_table:
        return Finished(plan.size, "")
    table_begin = plan.size - 8 * len(plan.tensors)
    hasher = SegmentHasher([(t.begin, t.begin + t.nbytes, str(i)) for i, t in enumerate(plan.tensors)])
    for offset in range(0, table_begin, WINDOW_BYTES):
        hasher.update(out.view[offset:min(offset + WINDOW_BYTES, table_begin)])
        out.release()
    hashes = [hasher.segment_hashes[str(i)] for i in range(len(plan.tensors))]
    table = hash_table_bytes(hashes)
    out.view[table_begin:plan.size] = table
    hasher.update(table)
    return Finished(plan.size, hasher.hexdigest, hashes)


def create_outputs(target: Location, plans: list[OutputPlan]) -> list[MappedOutput]:
    """Allocate every output's temp file (header written at finish); on failure none is left."""
    created: list[MappedOutput] = []
    try:
        for plan in plans:
            created.append(MappedOutput.create(target, plan.name, plan.size))
            created[-1].view[:len(plan.header)] = plan.header
            created[-1].close()
    except BaseException:
        for out in created:
            out.discard()
        raise
    return created


PIECE_BUDGET = 200_000  # pieces planned at once: bounds the plan's memory (~100 bytes each)


def split_tasks(plans: list[OutputPlan], source_world: int, workers: int = 1) -> list[Task]:
    """Tasks of whole outputs (consecutive, so each reads a narrow band of inputs), each planning at
    most about PIECE_BUDGET pieces; with workers, at least a few tasks per worker. An output
    without a hash table (a consolidated model) may be split by tensor ranges across tasks."""
    def pieces(t: OutTensor) -> int:
        return min(t.end - t.start, source_world) if t.source.layout == "flat" else 1

    budget = PIECE_BUDGET
    if workers > 1:
        total = sum(pieces(t) for plan in plans for t in plan.tensors)
        budget = max(1, min(PIECE_BUDGET, -(-total // (workers * 4))))
    tasks: list[Task] = []
    group: list[int] = []
    used = 0
    for index, plan in enumerate(plans):
        cost = sum(pieces(t) for t in plan.tensors)
        if cost > budget and not plan.hash_table:
            tasks += _split_output(index, plan, pieces, budget, workers)
            continue
        if group and used + cost > budget:
            tasks.append(Task(group))
            group, used = [], 0
        group.append(index)
        used += cost
    if group:
        tasks.append(Task(group))
    return tasks


def _split_output(index: int, plan: OutputPlan, pieces: Callable[[OutTensor], int], budget: int,
                  workers: int) -> list[Task]:
    """One big output's tensors in consecutive groups of about `budget` pieces (and, with workers,
    of about equal bytes)."""
    groups: list[list[int]] = [[]]
    used = 0
    byte_goal = sum(t.nbytes for t in plan.tensors) / (workers * 2) if workers > 1 else float("inf")
    group_bytes = 0
    for i, t in enumerate(plan.tensors):
        if groups[-1] and (used + pieces(t) > budget or group_bytes >= byte_goal):
            groups.append([])
            used = group_bytes = 0
        groups[-1].append(i)
        used += pieces(t)
        group_bytes += t.nbytes
    return [Task([index], {index: g}, finish=False) for g in groups]
