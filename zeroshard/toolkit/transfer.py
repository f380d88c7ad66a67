"""Rank-major copying, the local executor of a plan (zeroshard.toolkit.plan): every output file's
header and size computed up front, then each input rank file read once, front to back, each
piece of the plan dropped at its offset in the outputs. No partition arithmetic here.

This is how reshard and consolidate move bytes into local outputs. The cost is O(bytes + files +
fragments) with one memcpy per piece and no per-fragment open or system call (outputs are
memory-mapped, zeroshard.storage.mapped_file); a 1,024 -> 1,000 reshard of 300 tiny tensors is
about 600,000 pieces, so the per-piece path is kept short (and such jobs of many small files take
zeroshard.toolkit.packed instead, when whole outputs are written). Inputs are hash-checked as they
are read (files up to 1 MiB by their whole-file hash, bigger ones by the fragments used); 1.1
outputs get their fragment hashes, hash table and file hash in one pass over each finished file.
Work splits by Plan.split (whole files, or runs of pieces of files created up front, such as one
big consolidated file) into tasks that run in this process or in `workers` threads (big files) or
processes (zeroshard.toolkit.workers).

Outputs on S3 cannot be written out of order; those take the remote executor
(zeroshard.toolkit.stream): write_plan picks the executor for a command or a torchrun process.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterable

from zeroshard.errors import CheckpointError
from zeroshard.format import FileEntry, RankFileResult
from zeroshard.format.reader import CheckpointReader
from zeroshard.format.writer import hash_table_bytes
from zeroshard.storage.hashing import hash_bytes, new_hasher
from zeroshard.storage.location import Location
from zeroshard.storage.mapped_file import MappedOutput, move_into_place
from zeroshard.storage.safetensors_header import DTYPE_SIZES
from zeroshard.toolkit.output_hashes import InOrderHashes
from zeroshard.toolkit.plans import Finished, Job, OutputPlan, RankFilePlans, Task
from zeroshard.toolkit.workers import worker_pool

if TYPE_CHECKING:
    from zeroshard.format.manifest import Manifest
    from zeroshard.toolkit.plan import Plan

WINDOW_BYTES = 64 * 1024 * 1024  # how much of one input fragment is mapped (and resident) at a time
PWRITE_BYTES = 256 * 1024  # pieces this big go out by pwrite rather than a memcpy into the output's map
STEP_BYTES = 1024 * 1024  # a window is hashed and copied in steps this big: each stays in the CPU's cache
MAX_OPEN_INPUTS = 64  # big inputs of one task read side by side, at most this many at once


def write_plan(source: Location, manifest: Manifest, stage: Location, plan: Plan, workers: int = 1,
               progress: Callable[[int], None] | None = None, temp_paths: dict[int, str] | None = None,
               rank: int = 0, procs: int = 1, sync: bool = False) -> list[RankFileResult]:
    """Write process `rank` of `procs`'s share of `plan`'s outputs under `stage`; returns the rank
    files written. Local: rank-major (run_and_commit; `sync`: durable before the move), except
    outputs the caller created up front (`temp_paths`): filled by runs of pieces, left to it to move."""
    if not stage.local:
        from zeroshard.toolkit.stream import stream_outputs

        # streamed: an object has one writer, front to back, so outputs are dealt out whole, a contiguous
        # band per process (neighbouring outputs read neighbouring inputs), about equal in bytes
        parts = plan.split(procs)
        share = parts[rank] if rank < len(parts) else replace(plan.take(slice(0, 0)), output_sizes=[])
        return stream_outputs(source, manifest, stage, share, progress)
    from zeroshard.toolkit.plan import split_tasks  # numpy: when a copy starts

    job = Job(source.url, source.storage_options, manifest, stage.url, plan.outputs, temp_paths or {})
    tasks = split_tasks(plan, procs * max(workers, 1), whole_outputs=not temp_paths)[rank::procs]
    finished = run_and_commit(job, tasks, workers, progress, int(plan.written.sum()), sync)
    return _rank_file_results(finished)


def write_rank_files(source: Location, manifest: Manifest, stage: Location, outputs: RankFilePlans,
                     workers: int = 1, progress: Callable[[int], None] | None = None,
                     total_bytes: int = 0) -> list[RankFileResult]:
    """A local reshard's rank files under `stage` (synced by the commit): tasks of consecutive outputs, each
    planning its own pieces (plan.rank_file_tasks), so memory is bounded by a task, not by the
    world sizes. Remote stages take write_plan's streamed path."""
    from zeroshard.toolkit.plan import rank_file_tasks  # numpy: when a copy starts

    job = Job(source.url, source.storage_options, manifest, stage.url, outputs)
    tasks = rank_file_tasks(outputs, manifest.world_size, max(workers, 1))
    return _rank_file_results(run_and_commit(job, tasks, workers, progress, total_bytes))


def _rank_file_results(finished: dict[int, Finished]) -> list[RankFileResult]:
    # the fragment hashes are in each file's hash table; the manifest needs only the file entries
    return [RankFileResult(FileEntry(f.name, out_rank, f.size, f.file_hash), {})
            for out_rank, f in sorted(finished.items())]


def run_and_commit(job: Job, tasks: list[Task], workers: int = 1, progress: Callable[[int], None] | None = None,
                   total_bytes: int = 0, sync: bool = False) -> dict[int, Finished]:
    """Run `tasks` (here, or spread over `workers` threads or processes: workers.worker_pool), then
    move the outputs they wrote whole to their names; returns those. `sync`: every file the tasks
    wrote made durable first (the torchrun mode, where process 0 commits the others' files). On
    failure, removes every temp file the tasks made and raises. Progress: bytes as they are read
    here; with workers, an equal share of `total_bytes` per task done."""
    results: dict[int, Finished] = {}
    try:
        if workers <= 1 or len(tasks) <= 1:
            for task in tasks:
                results.update(run_task(job, task, progress))
        else:
            with worker_pool(min(workers, len(tasks)), [f.size for f in job.manifest.files]) as pool:
                # processes re-plan their own outputs, side by side, rather than unpickle the pieces
                # (pieces of outputs created up front cannot be re-planned: they travel)
                replan = not isinstance(pool, ThreadPoolExecutor) and not job.temp_paths
                futures = [pool.submit(run_task, job, replace(task, plan=None) if replan else task) for task in tasks]
                try:
                    for done, future in enumerate(futures):
                        results.update(future.result())
                        if progress is not None:
                            progress(total_bytes * (done + 1) // len(tasks) - total_bytes * done // len(tasks))
                except BaseException:
                    pool.shutdown(wait=True, cancel_futures=True)
                    for future in futures:
                        if future.done() and not future.cancelled() and future.exception() is None:
                            results.update(future.result())
                    raise
        target = Location(job.target_url, job.storage_options)  # every temp file is in it
        if sync:
            touched = {f.temp_path for f in results.values()} | {job.temp_paths[i] for t in tasks
                                                                 for i in t.outputs if i in job.temp_paths}
            target.fsync(sorted(path.rsplit("/", 1)[-1] for path in touched))
        commit(target, results.values())
    except BaseException:
        discard(results.values())
        raise
    return results


def create_outputs(target: Location, plan: Plan) -> list[Finished]:
    """Every output of `plan` created up front, at its size and with its header, for tasks that
    fill them side by side (Plan.split(whole_outputs=False)); on failure none is left."""
    created: list[Finished] = []
    try:
        for i in range(plan.outputs.count):
            output = plan.outputs.plan(i)
            out = MappedOutput.create(target, output.name, output.size)
            created.append(Finished(output.name, out.temp_path, output.size))
            out.view[:len(output.header)] = output.header
            out.close()
    except BaseException:
        discard(created)
        raise
    return created


def discard(finished: Iterable[Finished]) -> None:
    for f in finished:
        with contextlib.suppress(OSError):
            os.unlink(f.temp_path)


def commit(target: Location, finished: Iterable[Finished], durable: bool = False) -> None:
    """Move finished outputs to their names. `durable`: each synced before it appears under its name,
    and the folder entries after (Location.fsync; nothing to do on an object store)."""
    finished = list(finished)
    if durable:
        target.fsync([f.temp_path.rsplit("/", 1)[-1] for f in finished])
    for f in finished:
        move_into_place(target, f.temp_path, f.name)
    if durable:
        target.fsync([f.name for f in finished])


def run_task(job: Job, task: Task, progress: Callable[[int], None] | None = None) -> dict[int, Finished]:
    """Fill this task's share of the outputs, reading each needed input file once, in rank order."""
    whole = not job.temp_paths  # else the outputs were created up front: filled here, finished by the caller
    if whole and isinstance(job.planner, RankFilePlans):
        from zeroshard.toolkit import packed

        if packed.fits(job, job.planner):  # many small files: built in memory, one write each
            done = packed.run_packed(job, job.planner, task, progress)
            if done is not None:
                return done
    source = Location(job.source_url, job.storage_options)
    target = Location(job.target_url, job.storage_options)
    plans = {i: job.planner.plan(i) for i in task.outputs}
    outputs: dict[int, MappedOutput] = {}
    try:
        for i, plan in plans.items():
            if whole:
                outputs[i] = MappedOutput.create(target, plan.name, plan.size)
                outputs[i].view[:len(plan.header)] = plan.header
            else:
                outputs[i] = MappedOutput.attach(target, plan.name, job.temp_paths[i], plan.size)
        # hashes taken during the copy, for whole rank files (others: none needed, or not ours)
        taken = {i: InOrderHashes(plan.header, [(t.begin, t.begin + t.nbytes) for t in plan.tensors])
                 for i, plan in plans.items() if plan.hash_table and whole}
        # the plan's pieces: from small local inputs, read whole a batch at a time, through numpy
        # (gather.py); from big (or remote) ones, read side by side, up to MAX_OPEN_INPUTS at once
        from zeroshard.toolkit import gather  # numpy: imported when a copy starts, not with the command
        from zeroshard.toolkit.plan import plan_ranks

        plan = task.plan if task.plan is not None else plan_ranks(job.manifest, job.planner, task.outputs)
        if source.local:
            plan = gather.copy_small_inputs(source, job.manifest, plan, outputs, progress, job.verify_hashes)
        needed = _pieces_by_input(job.manifest, plan)
        big = sorted(needed)
        with CheckpointReader(source, job.manifest, verify_hashes=job.verify_hashes) as reader:
            for at in range(0, len(big), MAX_OPEN_INPUTS):
                group = {rank: needed.pop(rank) for rank in big[at:at + MAX_OPEN_INPUTS]}
                _copy_side_by_side(reader, group, outputs, progress, taken)
                reader.close()
        if not whole:
            return {}
        return {i: _finish(plans[i], outputs[i], taken.get(i)) for i in task.outputs}
    except BaseException:
        if whole:
            for out in outputs.values():
                out.discard()
        raise
    finally:
        for out in outputs.values():
            out.close()


# A piece: (offset in the input fragment, output index, byte offset in the output, elements, output dtype)
Piece = tuple[int, int, int, int, str]


def _pieces_by_input(manifest: Manifest, plan: Plan) -> dict[int, dict[str, list[Piece]]]:
    """The plan's pieces by input rank and tensor, as the copy loops take them."""
    needed: dict[int, dict[str, list[Piece]]] = {}
    import numpy as np

    size = np.array([t.itemsize for t in manifest.tensors.values()], dtype=np.int64)[plan.tensor]
    dtypes = [t.dtype for t in manifest.tensors.values()]
    columns = (plan.input, plan.tensor, (plan.input_offset - plan.input_fragment) // size, plan.output,
               plan.output_offset, plan.nbytes // size, plan.cast)
    for rank, tensor, src, index, dst, count, cast in zip(*(c.tolist() for c in columns)):
        needed.setdefault(rank, {}).setdefault(plan.tensor_names[tensor], []).append(
            (src, index, dst, count, plan.casts[cast][1] if cast else dtypes[tensor]))
    return needed


def _copy_side_by_side(reader: CheckpointReader, inputs: dict[int, dict[str, list[Piece]]],
                       outputs: dict[int, MappedOutput], progress: Callable[[int], None] | None,
                       hashes: dict[int, InOrderHashes]) -> None:
    """Big or remote files, open together, fragment by fragment in tensor order and, per
    tensor, in rank order. Each input is still read front to back (its fragments are in tensor
    order), and each output is now written front to back too, even one drawing on several
    inputs (8 -> 6), so its hashes ride on the copy (output_hashes.py) instead of costing a read
    of the finished file."""
    position = {name: i for i, name in enumerate(reader.manifest.tensors)}
    order = sorted((position[name], rank, name) for rank, fragments in inputs.items() for name in fragments)
    recorded: dict[int, dict[str, str] | None] = {}
    scratch = [bytearray()]
    for _, rank, name in order:
        opened = reader.open_file(rank)
        if rank not in recorded:
            recorded[rank] = reader.fragment_hashes(rank) if reader.verify_hashes else None
        done = _copy_fragment(reader, rank, opened, name, inputs[rank][name], outputs, recorded[rank], hashes,
                              scratch)
        if progress is not None:
            progress(done)


def _copy_fragment(reader: CheckpointReader, rank: int, opened, name: str, pieces: list[Piece],
                   outputs: dict[int, MappedOutput], recorded: dict[str, str] | None,
                   hashes: dict[int, InOrderHashes], scratch: list[bytearray]) -> int:
    """One input fragment through windows of WINDOW_BYTES, released as they go; returns its bytes.

    Each window is worked through in cache-sized steps: a step is hashed (the input check), then
    written out and fed to its outputs' hashes while it is still in the CPU's cache, so every
    input byte comes from memory once.
    """
    entry, tensor = opened.header.entries[name], reader.manifest.tensors[name]
    size = tensor.itemsize
    if len(pieces) > 1:
        pieces.sort()
    length = entry.end - entry.begin
    window = max(size, WINDOW_BYTES // size * size)
    step_bytes = max(size, STEP_BYTES // size * size)
    hasher = new_hasher() if recorded is not None else None
    first_piece = 0  # pieces before this one end before the current step (sorted by source offset)
    for w0 in range(0, length, window):
        wlen = min(window, length - w0)
        view = opened.reader.view(entry.begin + w0, wlen)
        if view is None:  # remote input: read the window into the caller's reused buffer
            if len(scratch[0]) < wlen:
                scratch[0] = bytearray(wlen)
            view = memoryview(scratch[0])[:wlen]
            opened.reader.read_into(entry.begin + w0, view)
        for s0 in range(0, wlen, step_bytes):
            step = view[s0:s0 + step_bytes]
            if hasher is not None:
                hasher.update(step)
            first, last = (w0 + s0) // size, (w0 + s0 + len(step)) // size
            while first_piece < len(pieces) and pieces[first_piece][0] + pieces[first_piece][3] <= first:
                first_piece += 1
            for j in range(first_piece, len(pieces)):
                src, index, dst, count, dtype = pieces[j]
                if src >= last:
                    break
                lo, hi = max(src, first), min(src + count, last)
                if lo >= hi:
                    continue
                data = step[(lo - first) * size:(hi - first) * size]
                if dtype != tensor.dtype:
                    from zeroshard.toolkit.gather import cast_bytes  # numpy and torch: only for a cast

                    data = cast_bytes(data, tensor.dtype, dtype)
                at = dst + (lo - src) * DTYPE_SIZES[dtype]
                out = outputs[index]
                if len(data) >= PWRITE_BYTES:
                    out.pwrite(data, at)
                else:
                    out.view[at:at + len(data)] = data
                    out.wrote(len(data))
                if index in hashes:
                    hashes[index].feed(at, data)
            del step
        del view
        opened.reader.release(entry.begin + w0, wlen)  # drop what was read from this process's map
    if hasher is not None and hasher.hexdigest() != recorded[name]:
        raise CheckpointError(reader.where(rank), f"tensor {name!r}: content hash mismatch (file corrupt or modified)")
    return length


def _finish(plan: OutputPlan, out: MappedOutput, taken: InOrderHashes | None) -> Finished:
    """For rank files: the fragment-hash table, and every hash: those the copy took in order
    (output_hashes.py), the rest from a read of the finished file."""
    if not plan.hash_table:
        return Finished(plan.name, out.temp_path, plan.size)
    hashes = [(taken and taken.region_hash(i)) or _hash_region(out, t.begin, t.begin + t.nbytes)
              for i, t in enumerate(plan.tensors)]
    table_begin = plan.size - 8 * len(plan.tensors)
    table = hash_table_bytes(hashes)
    out.view[table_begin:plan.size] = table
    file_hash = (taken and taken.file_hash(table_begin, table)) or _hash_region(out, 0, plan.size)
    return Finished(plan.name, out.temp_path, plan.size, file_hash)


def _hash_region(out: MappedOutput, begin: int, end: int) -> str:
    if end - begin <= WINDOW_BYTES:
        digest = hash_bytes(out.view[begin:end])
        out.wrote(end - begin)  # read pages count too: dropped every 64 MiB
        return digest
    hasher = new_hasher()
    for offset in range(begin, end, WINDOW_BYTES):  # big regions: bounded residency
        hasher.update(out.view[offset:min(offset + WINDOW_BYTES, end)])
        out.wrote(min(WINDOW_BYTES, end - offset))  # read pages count too: dropped every 64 MiB
    return hasher.hexdigest()
