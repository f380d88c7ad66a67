"""Many small rank files, built in memory: the tensors x ranks case of a local reshard.

Taken for jobs of 64+ files whose outputs are all under 8 MiB and inputs under 64 MiB.

A reshard of 300 tiny tensors from 1,024 to 1,000 ranks moves 5 MB in 600,000 pieces between
2,000 files; what costs is per file and per piece, not per byte. So, for a task's consecutive
output files (zeroshard.toolkit.plans.split_tasks):

- the input files the task needs are each read whole in one call into one buffer, and each is
  checked with one hash: the manifest's whole-file hash covers every byte, header and hash table
  included, so no fragment hash needs computing (those are for readers of part of a file). The
  header must be byte-identical to the one the manifest implies (zeroshard.format.layouts);
- every piece is planned with array arithmetic (the partition rule over every output fragment of
  the task at once) and copied with one numpy gather into one buffer holding all the outputs;
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

from zeroshard.errors import CheckpointError, StorageError
from zeroshard.format.layouts import RankLayouts
from zeroshard.format.manifest import FORMAT_VERSION, Manifest, rank_file_name
from zeroshard.format.reader import CheckpointReader
from zeroshard.partition_arrays import holders, shard_ranges
from zeroshard.storage.location import Location
from zeroshard.toolkit.plans import Finished, Job, RankFilePlans, Task

PACK_FILE_BYTES = 8 * 1024 * 1024  # outputs up to this size take this path
PACK_INPUT_BYTES = 64 * 1024 * 1024  # ... from inputs up to this size (read whole, by every task that needs them)
TASK_INPUT_BYTES = 192 * 1024 * 1024  # a task needing more input than this is left to the general path
PACK_MIN_FILES = 64  # inputs + outputs: below this, per-file costs do not matter and the general path serves
GATHER_MAX_BYTES = 64 * 1024  # bigger pieces are copied as slices
GATHER_ELEMENTS = 1 << 20  # index arrays built per gather: bounds their memory (~25 MiB)

_layouts: dict[tuple, RankLayouts] = {}  # per process: tasks of one job share them


def fits(job: Job, planner: RankFilePlans) -> bool:
    """Whether this job's inputs and outputs are local files small enough for this path."""
    if len(job.manifest.files) + planner.world_size < PACK_MIN_FILES:
        return False
    if max(f.size for f in job.manifest.files) > PACK_INPUT_BYTES:
        return False
    source, target = Location(job.source_url, job.storage_options), Location(job.target_url, job.storage_options)
    if not (source.local and target.local):
        return False
    out = _cached(planner.tensors, planner.world_size, planner.checkpoint_id, FORMAT_VERSION, True)
    return max(out.file_size(run.end - 1) for run in out.runs) <= PACK_FILE_BYTES


def _cached(tensors, world_size: int, checkpoint_id: str, version: str, hash_table: bool) -> RankLayouts:
    # keyed by everything a layout depends on: an id alone could be reused by a hand-made manifest
    key = (checkpoint_id, world_size, version, hash_table,
           tuple((t.name, t.dtype, t.shape, t.layout, t.owner) for t in tensors))
    if key not in _layouts:
        if len(_layouts) > 4:
            _layouts.clear()
        _layouts[key] = RankLayouts(tensors, world_size, checkpoint_id, version, hash_table)
    return _layouts[key]


def _input_layouts(manifest: Manifest) -> RankLayouts:
    return _cached(list(manifest.tensors.values()), manifest.world_size, manifest.id, manifest.version,
                   manifest.legacy_hashes is None)


def _arrays(run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A run's (tensor indices, begins, sizes) as arrays, made once."""
    if run.arrays is None:
        run.arrays = tuple(np.asarray(column, dtype=np.int64) for column in (run.tensors, run.begin, run.nbytes))
    return run.arrays


class _Fallback(Exception):
    """This task cannot be done here; the general path will do it (and explain what is off)."""


def run_packed(job: Job, planner: RankFilePlans, task: Task,
               progress: Callable[[int], None] | None) -> dict[int, Finished] | None:
    """Write the task's whole outputs; None when the general path must do it instead."""
    try:
        return _run(job, planner, task, progress)
    except _Fallback:
        return None


def _run(job: Job, planner: RankFilePlans, task: Task,
         progress: Callable[[int], None] | None) -> dict[int, Finished]:

    manifest = job.manifest
    source_layouts = _input_layouts(manifest)
    out_layouts = _cached(planner.tensors, planner.world_size, planner.checkpoint_id, FORMAT_VERSION, True)
    index_in = np.array([source_layouts.index.get(t.name, -1) for t in out_layouts.tensors], dtype=np.int64)
    if (index_in < 0).any():
        raise _Fallback
    numel = np.array([t.numel for t in out_layouts.tensors], dtype=np.int64)
    itemsize = np.array([t.itemsize for t in out_layouts.tensors], dtype=np.int64)
    flat = np.array([t.layout == "flat" for t in out_layouts.tensors], dtype=bool)
    holder = np.array([0 if t.layout == "whole" else t.owner for t in out_layouts.tensors], dtype=np.int64)
    if any(a.dtype != b.dtype for a, b in zip(out_layouts.tensors, (source_layouts.tensors[i] for i in index_in))):
        raise _Fallback

    # Outputs: headers, sizes, places in one buffer (8-aligned, so element views line up).
    ranks = sorted(task.outputs)
    runs, headers = [], []
    for r in ranks:
        runs.append(out_layouts.rank_layout(r))
        headers.append(out_layouts.header(r))
    sizes = [len(h) + run.data_bytes for h, run in zip(headers, runs)]
    bases = np.cumsum([0] + [-(-s // 8) * 8 for s in sizes])
    out_buf = bytearray(int(bases[-1]))
    for h, b in zip(headers, bases.tolist()):
        out_buf[b:b + len(h)] = h

    # Every output fragment of the task: (output position, tensor, byte offset in out_buf, bytes),
    # built per group of consecutive outputs sharing a layout.
    parts = []
    k = 0
    while k < len(ranks):
        run = runs[k]
        n = next((j for j in range(k, len(ranks)) if runs[j] is not run), len(ranks)) - k
        tensors, begin, size = _arrays(run)
        data_at = bases[k:k + n] + np.array([len(h) for h in headers[k:k + n]], dtype=np.int64)
        parts.append((np.repeat(np.arange(k, k + n), len(tensors)), np.tile(tensors, n),
                      np.tile(begin, n) + np.repeat(data_at, len(tensors)), np.tile(size, n)))
        k += n
    pos, tid, off, nbytes = (np.concatenate(column) for column in zip(*parts))
    out_rank = np.asarray(ranks, dtype=np.int64)[pos]
    start = np.where(flat[tid], shard_ranges(numel[tid], planner.world_size, out_rank)[0], 0)
    end = start + nbytes // itemsize[tid]

    # Cut each at the input's rank boundaries (flat), or take it from its holder (whole, local:
    # one rank holding all, as a world of 1 shifted to the holder).
    in_world = manifest.world_size
    found = holders(numel[tid], np.where(flat[tid], in_world, 1), start, end)
    which, frag_start, lo, hi = found.row, found.rank_start, found.lo, found.hi
    t = tid[which]
    rank_in = found.rank + np.where(flat[t], 0, holder[t])
    size = itemsize[t]
    dst = off[which] + (lo - start[which]) * size
    piece_bytes = (hi - lo) * size

    # Inputs: each read whole, checked, placed in one buffer (8-aligned).
    present = np.zeros(in_world, dtype=bool)
    present[rank_in] = True
    needed = np.flatnonzero(present)
    files = [manifest.file_for_rank(q) for q in needed.tolist()]
    in_base = np.cumsum([0] + [-(-f.size // 8) * 8 for f in files])
    if in_base[-1] > TASK_INPUT_BYTES:
        raise _Fallback  # memory: the general path maps inputs through bounded windows instead
    in_buf = bytearray(int(in_base[-1]))
    in_view = memoryview(in_buf)
    source = Location(job.source_url, job.storage_options)
    data_at = np.empty(len(files), dtype=np.int64)  # where each input's data section starts in in_buf
    for i, (q, file, base) in enumerate(zip(needed.tolist(), files, in_base.tolist())):
        data = in_view[base:base + file.size]
        if not source.read_whole_into(file.name, data):
            raise _Fallback
        if job.verify_hashes and xxhash.xxh3_64_hexdigest(data) != file.hash:
            _explain_mismatch(source, manifest, q)
        header = source_layouts.header(q)
        if file.size != source_layouts.file_size(q, header) or data[:len(header)].tobytes() != header:
            raise _Fallback  # a header composed otherwise (a valid file from another writer?): parse it there
        data_at[i] = base + len(header)

    # Where each piece starts in in_buf: its input's data section + the fragment's offset there.
    slot = np.zeros(in_world, dtype=np.int64)
    slot[needed] = np.arange(len(needed))
    piece_slot = slot[rank_in]
    in_runs = np.asarray(source_layouts.starts, dtype=np.int64)
    run_of_needed = np.searchsorted(in_runs, needed, side="right") - 1
    used = np.unique(run_of_needed).tolist()
    table = np.full((len(used), len(source_layouts.tensors)), -1, dtype=np.int64)  # run, tensor -> begin
    for row, r in enumerate(used):
        run = source_layouts.runs[r]
        table[row, run.tensors] = run.begin
    row_of = np.zeros(len(source_layouts.runs), dtype=np.int64)
    row_of[used] = np.arange(len(used))
    begins = table[row_of[run_of_needed[piece_slot]], index_in[t]]
    for i in np.flatnonzero(begins < 0).tolist():  # per-rank tensors (kept at the same world size)
        q, wanted = int(rank_in[i]), int(index_in[t[i]])
        layout = source_layouts.rank_layout(q)
        if wanted not in layout.tensors:
            raise _Fallback  # a piece the input's layout does not hold: never expected
        begins[i] = layout.begin[layout.tensors.index(wanted)]
    src = data_at[piece_slot] + begins + (lo - frag_start) * size
    _gather(out_buf, in_buf, src, dst, piece_bytes)
    del in_view, in_buf

    # Hash table and file hash of each output, then one write each.
    view = memoryview(out_buf)
    hashes = np.fromiter((xxhash.xxh3_64_intdigest(view[a:a + n]) for a, n in zip(off.tolist(), nbytes.tolist())),
                         dtype=np.uint64, count=len(off)).astype("<u8")
    splits = np.searchsorted(pos, np.arange(len(ranks) + 1))
    target = Location(job.target_url, job.storage_options)
    target.makedirs()
    finished: dict[int, Finished] = {}
    try:
        for k, r in enumerate(ranks):
            b, h, run = int(bases[k]), len(headers[k]), runs[k]
            table = b + h + run.table_begin
            out_buf[table:table + 8 * (splits[k + 1] - splits[k])] = hashes[splits[k]:splits[k + 1]].tobytes()
            data = view[b:b + sizes[k]]
            name = rank_file_name(r, planner.world_size)
            temp = target.temp_name(name)  # one write to a new file; synced later, with the others
            if not target.create_exclusive(temp, data, durable=False):
                raise StorageError(target.url_of(temp), "exists already")  # a fresh random name: never expected
            # fragment hashes are in the file's table; nothing downstream needs them again here
            finished[r] = Finished(name, target.full_path(temp), sizes[k], xxhash.xxh3_64_hexdigest(data))
    except BaseException:
        for done in finished.values():
            with contextlib.suppress(StorageError):
                target.remove(done.temp_path.rsplit("/", 1)[-1])
        raise
    if progress is not None:
        progress(sum(f.size for f in files))
    return finished


def _explain_mismatch(source: Location, manifest: Manifest, rank: int) -> None:
    """An input's whole-file hash does not match: name the tensor if a fragment hash shows which,
    else the file (its header or hash table changed). Always raises."""
    with CheckpointReader(source, manifest) as reader:
        opened = reader.open_file(rank)  # a header that disagrees with the manifest raises here, naming it
        recorded = reader.fragment_hashes(rank)
        for name, entry in opened.header.entries.items():
            if name in recorded:
                data = opened.reader.read(entry.begin, entry.end - entry.begin)
                if xxhash.xxh3_64_hexdigest(data) != recorded[name]:
                    raise CheckpointError(reader.where(rank),
                                          f"tensor {name!r}: content hash mismatch (file corrupt or modified)")
        raise CheckpointError(reader.where(rank), "content hash mismatch (file corrupt or modified)")


def _gather(out_buf: bytearray, in_buf: bytearray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
    """out_buf[dst[i]:dst[i]+nbytes[i]] = in_buf[src[i]:src[i]+nbytes[i]] for every i: small pieces
    by fancy indexing, in the widest element both sides' offsets allow, big ones as slices."""
    keep = nbytes > 0
    src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
    big = nbytes >= GATHER_MAX_BYTES
    out_view, in_view = memoryview(out_buf), memoryview(in_buf)
    for s, d, n in zip(src[big].tolist(), dst[big].tolist(), nbytes[big].tolist()):
        out_view[d:d + n] = in_view[s:s + n]
    src, dst, nbytes = src[~big], dst[~big], nbytes[~big]
    if not len(src):
        return
    mask = int(np.bitwise_or.reduce(src | dst | nbytes)) | 8
    width = mask & -mask  # 1, 2, 4 or 8: the largest unit dividing every offset and length
    unit = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    target = np.frombuffer(out_buf, dtype=unit, count=len(out_buf) // width)
    source = np.frombuffer(in_buf, dtype=unit, count=len(in_buf) // width)
    src, dst, count = src // width, dst // width, nbytes // width
    ends = np.cumsum(count)
    cut = 0
    while cut < len(count):  # bounded batches: the index arrays hold one entry per element
        stop = max(int(np.searchsorted(ends, ends[cut] - count[cut] + GATHER_ELEMENTS, side="right")), cut + 1)
        c = count[cut:stop]
        within = np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)
        target[np.repeat(dst[cut:stop], c) + within] = source[np.repeat(src[cut:stop], c) + within]
        cut = stop
