"""`shard` into many small rank files, built in memory: reshard's packed path (packed.py) with the
model file as its one input.

Taken for local sources and outputs when the checkpoint has 64+ rank files all under 8 MiB:
there, writing rank by rank costs per fragment (a ranged read, a hash and a write call each: at
16,384 ranks of 300 tensors, 4.9M of them) where a reshard writing the same files costs per task.
So, for each task of consecutive output ranks (plan.rank_file_tasks):

- each tensor's bytes for the task's ranks, contiguous in the model file, are read with one
  ranged read into one buffer;
- every fragment is copied into one buffer holding the task's outputs (their headers composed
  once per run of alike ranks, zeroshard.format.layouts) with one numpy gather (gather.copy_pieces);
- each output's hash table and file hash are computed and it is written with one write()
  (packed.write_outputs), then moved to its name.

The files are byte for byte those the rank-by-rank writer (format.write_rank_file) makes.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from zeroshard.format import FileEntry, RankFileResult, TensorSpec
from zeroshard.format.full_model import SourceTensor
from zeroshard.storage.location import Location
from zeroshard.toolkit.gather import copy_pieces
from zeroshard.toolkit.packed import PACK_MIN_FILES, output_buffer, outputs_small, write_outputs
from zeroshard.toolkit.plan import output_rows, rank_file_tasks
from zeroshard.toolkit.plans import RankFilePlans
from zeroshard.toolkit.transfer import commit, discard


def fits(folder: Location, stage: Location, outputs: RankFilePlans) -> bool:
    """Whether the model's folder and the output are local and the rank files many and small."""
    if not (folder.local and stage.local) or outputs.world_size < PACK_MIN_FILES:
        return False
    return outputs_small(outputs)


def write_packed(folder: Location, sources: dict[str, SourceTensor], outputs: RankFilePlans, stage: Location,
                 progress: Callable[[int], None]) -> list[RankFileResult]:
    """Every rank file of `outputs` into `stage` under its name (durable at the checkpoint's
    commit, with the others); returns them for the manifest. On failure none is left."""
    tensors: list[TensorSpec] = outputs.layouts.tensors
    source_of = [sources[t.name] for t in tensors]
    files = sorted({s.file for s in source_of})
    file_index = np.array([files.index(s.file) for s in source_of], dtype=np.int64)
    begin = np.array([s.begin for s in source_of], dtype=np.int64)
    itemsize = np.array([t.itemsize for t in tensors], dtype=np.int64)
    readers = {name: folder.open_reader(name, follow_links=True) for name in files}
    written = []
    try:  # a failure leaves rank files in the stage: prepare_output's transaction abandons it
        for task in rank_file_tasks(outputs, 1):
            sizes = [0] * outputs.world_size
            out, tid, start, end, at = output_rows(outputs, task.outputs, sizes)
            mine = [sizes[r] for r in task.outputs]
            out_buf, out_at = output_buffer(outputs.layouts, task.outputs, mine)
            src = begin[tid] + start * itemsize[tid]
            nbytes = (end - start) * itemsize[tid]
            in_buf, in_at = _read_spans(readers, files, file_index, tid, src, nbytes)
            copy_pieces(out_buf, in_buf, in_at, out_at[out] + at, nbytes)
            del in_buf
            done = write_outputs(stage, outputs.layouts, task.outputs, mine, out_buf, out_at)
            try:
                commit(stage, done.values())  # under their names in the stage, synced at the checkpoint's commit
            except BaseException:
                discard(done.values())
                raise
            written.extend(done.items())
            progress(int(nbytes.sum()))
    finally:
        for reader in readers.values():
            reader.close()
    return [RankFileResult(FileEntry(f.name, rank, f.size, f.file_hash), {}) for rank, f in written]


def _read_spans(readers: dict, files: list[str], file_index: np.ndarray, tid: np.ndarray, src: np.ndarray,
                nbytes: np.ndarray) -> tuple[bytearray, np.ndarray]:
    """One ranged read per tensor of the bytes its pieces span (consecutive ranks' fragments of a
    tensor are contiguous in the model file), into one buffer; each piece's offset in it."""
    order = np.unique(tid)
    lo = np.full(tid.max(initial=0) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.zeros(tid.max(initial=0) + 1, dtype=np.int64)
    np.minimum.at(lo, tid, src)
    np.maximum.at(hi, tid, src + nbytes)
    spans = np.where(hi[order] > lo[order], hi[order] - lo[order], 0)
    base = np.zeros(len(lo), dtype=np.int64)
    base[order] = np.cumsum(np.r_[0, spans[:-1]])
    buf = bytearray(int(spans.sum()))
    view = memoryview(buf)
    for t, b, n in zip(order.tolist(), base[order].tolist(), spans.tolist()):
        if n:
            readers[files[int(file_index[t])]].read_into(int(lo[t]), view[b:b + n])
    return buf, base[tid] + (src - lo[tid])
