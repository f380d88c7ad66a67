"""Many small rank files, built in memory: the tensors x ranks case of a local reshard.

Taken for jobs of 64+ files whose outputs are all under 8 MiB and inputs under 64 MiB.

A reshard of 300 tiny tensors from 1,024 to 1,000 ranks moves 5 MB in 600,000 pieces between
2,000 files; what costs is per file and per piece, not per byte. So, for a task's consecutive
output files (zeroshard.toolkit.plans.split_tasks):

- the input files the task needs are each read whole in one call into one buffer, and each is
  checked with one hash: the manifest's whole-file hash covers every byte, header and hash table
  included, so no fragment hash needs computing (those are for readers of part of a file). The
  header must be byte-identical to the one the manifest implies (zeroshard.format.layouts);
- every piece comes from the plan (zeroshard.toolkit.plan.plan_ranks: array arithmetic over the
  task's outputs) and is copied with one numpy gather into one buffer holding all the outputs;
- each output's fragments are hashed while hot, its hash table and whole-file hash computed, and
  it is written with one write() to a new temp file: no fallocate, no map, no second open.

Anything unexpected in an input (another size, a link, a header composed otherwise) makes the
task fall back to the general path (transfer.run_task), which parses, checks and names the
problem; a whole-file hash mismatch is reported naming the tensor when a fragment hash shows
which one.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import xxhash

from zeroshard.errors import StorageError
from zeroshard.format.layouts import RankLayouts
from zeroshard.format.manifest import rank_file_name
from zeroshard.storage.location import Location
from zeroshard.toolkit.gather import copy_pieces, read_whole
from zeroshard.toolkit.plan import plan_ranks, run_arrays
from zeroshard.toolkit.plans import Finished, Job, RankFilePlans, Task

PACK_FILE_BYTES = 8 * 1024 * 1024  # outputs up to this size take this path
PACK_INPUT_BYTES = 64 * 1024 * 1024  # ... from inputs up to this size (read whole, by every task that needs them)
TASK_INPUT_BYTES = 192 * 1024 * 1024  # a task needing more input than this is left to the general path
PACK_MIN_FILES = 64  # inputs + outputs: below this, per-file costs do not matter and the general path serves

def fits(job: Job, planner: RankFilePlans) -> bool:
    """Whether this job's inputs and outputs are local files small enough for this path."""
    if len(job.manifest.files) + planner.world_size < PACK_MIN_FILES:
        return False
    if max(f.size for f in job.manifest.files) > PACK_INPUT_BYTES:
        return False
    source, target = Location(job.source_url, job.storage_options), Location(job.target_url, job.storage_options)
    if not (source.local and target.local):
        return False
    return outputs_small(planner)


def outputs_small(planner: RankFilePlans) -> bool:
    """Whether every output rank file is at most PACK_FILE_BYTES (checked once per run of alike
    ranks: they hold the same fragments)."""
    return max(planner.layouts.file_size(run.end - 1) for run in planner.layouts.runs) <= PACK_FILE_BYTES


def run_packed(job: Job, planner: RankFilePlans, task: Task,
               progress: Callable[[int], None] | None) -> dict[int, Finished] | None:
    """Write the task's whole outputs; None when the general path must do it instead (and
    explain what is off), before anything is written."""
    manifest, layouts, ranks = job.manifest, planner.layouts, sorted(task.outputs)
    plan = task.plan if task.plan is not None else plan_ranks(manifest, planner, ranks)  # pieces (toolkit.plan)

    sizes = [plan.output_sizes[r] for r in ranks]
    out_buf, out_at = output_buffer(layouts, ranks, sizes)

    # Inputs: each read whole, checked, placed in one buffer (gather.read_whole).
    needed = np.unique(plan.input)
    files = [manifest.file_for_rank(q) for q in needed.tolist()]
    if sum(-(-f.size // 8) * 8 for f in files) > TASK_INPUT_BYTES:
        return None  # memory: the general path maps inputs through bounded windows instead
    read = read_whole(Location(job.source_url, job.storage_options), manifest, needed, job.verify_hashes)
    if read is None:
        return None
    in_buf, in_at = read
    copy_pieces(out_buf, in_buf, in_at[plan.input] + plan.input_offset, out_at[plan.output] + plan.output_offset,
                plan.nbytes)
    del in_buf
    finished = write_outputs(Location(job.target_url, job.storage_options), layouts, ranks, sizes, out_buf, out_at)
    if progress is not None:
        progress(sum(f.size for f in files))
    return finished


def output_buffer(layouts: RankLayouts, ranks: list[int], sizes: list[int]) -> tuple[bytearray, np.ndarray]:
    """One buffer for the outputs `ranks` (ascending) of `sizes` bytes, each 8-aligned (so element
    views line up) with its header in place; and each output's offset in it, indexed by rank."""
    bases = np.cumsum([0] + [-(-s // 8) * 8 for s in sizes])
    out_buf = bytearray(int(bases[-1]))
    for r, b in zip(ranks, bases.tolist()):
        header = layouts.header(r)
        out_buf[b:b + len(header)] = header
    out_at = np.zeros(layouts.world_size, dtype=np.int64)
    out_at[ranks] = bases[:-1]
    return out_buf, out_at


def write_outputs(target: Location, layouts: RankLayouts, ranks: list[int], sizes: list[int], out_buf: bytearray,
                  out_at: np.ndarray) -> dict[int, Finished]:
    """Each output's hash table and file hash, then one write each to a new temp file in `target`
    (synced later, with the others); on failure none is left."""
    view = memoryview(out_buf)
    target.makedirs()
    finished: dict[int, Finished] = {}
    try:
        for r, size in zip(ranks, sizes):
            run, base = layouts.rank_layout(r), int(out_at[r])
            data_at = base + layouts.header_length(r)
            _, begin, nbytes = run_arrays(run)
            begin = begin + data_at  # maps, not a Python loop: 300,000 fragments in a 1,000-rank task
            hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, map(view.__getitem__, map(
                slice, begin.tolist(), (begin + nbytes).tolist()))), dtype=np.uint64, count=len(begin))
            table = data_at + run.table_begin
            out_buf[table:table + 8 * len(hashes)] = hashes.astype("<u8").tobytes()
            data = view[base:base + size]
            name = rank_file_name(r, layouts.world_size)
            temp = target.temp_name(name)
            if not target.create_exclusive(temp, data, durable=False):
                raise StorageError(target.url_of(temp), "exists already")  # a fresh random name: never expected
            # fragment hashes are in the file's table; nothing downstream needs them again here
            finished[r] = Finished(name, target.full_path(temp), size, xxhash.xxh3_64_hexdigest(data))
    except BaseException:
        for done in finished.values():
            with contextlib.suppress(StorageError):
                target.remove(done.temp_path.rsplit("/", 1)[-1])
        raise
    return finished

