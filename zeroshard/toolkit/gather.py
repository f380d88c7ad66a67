"""Many small fragments, copied with numpy: the tensors x ranks case of rank-major copying.

A reshard of 300 tensors from 1,024 to 1,000 ranks is about 600,000 pieces of a few bytes each. A
Python loop spends microseconds on each; here a plan's pieces (zeroshard.toolkit.plan) are
copied with one gather per (input file, output file) pair. Used by zeroshard.toolkit.transfer
for pieces copied without a dtype cast from small local input files; everything else takes the
per-piece path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from zeroshard.errors import CheckpointError
from zeroshard.storage.hashing import hash_bytes

if TYPE_CHECKING:
    from zeroshard.format.reader import CheckpointReader
    from zeroshard.storage.mapped_file import MappedOutput
    from zeroshard.toolkit.plan import Plan

WHOLE_HASH_BYTES = 1024 * 1024  # inputs up to this size are checked by their whole-file hash
GATHER_MAX_BYTES = 64 * 1024  # larger pieces are copied as slices (an index per byte would cost more)


def by_input(plan: Plan) -> list[tuple[Plan, int]]:
    """The plan's pieces in groups of one input file each (sorted by tensor), with its rank."""
    plan = plan.take(np.lexsort((plan.tensor, plan.input)))
    starts = np.flatnonzero(np.r_[True, plan.input[1:] != plan.input[:-1]]) if len(plan) else []
    return [(plan.take(slice(a, b)), int(plan.input[a])) for a, b in zip(starts, [*starts[1:], len(plan)])]


def copy_from_input(reader: "CheckpointReader", rank: int, pieces: Plan, outputs: dict[int, "MappedOutput"],
                    progress: Callable[[int], None] | None) -> None:
    """Copy `pieces` (all from `rank`'s file, which must be local and mapped whole)."""
    opened = reader.open_file(rank)
    size = opened.header.file_size
    whole = opened.reader.view(0, size)
    entries = opened.header.entries
    tids = pieces.tensor
    unique = np.unique(tids)
    begins = np.empty(len(unique), dtype=np.int64)
    if reader.verify_hashes:
        check_input(reader, rank, whole, [pieces.tensor_names[tid] for tid in unique.tolist()])
    for i, tid in enumerate(unique.tolist()):
        begins[i] = entries[pieces.tensor_names[tid]].begin
    # the fragment's place as read in the header, plus the piece's offset inside it
    source = begins[np.searchsorted(unique, tids)] + pieces.input_offset - pieces.input_fragment
    source_bytes = np.frombuffer(whole, dtype=np.uint8)
    outs, cast = pieces.output, pieces.cast
    for index in np.unique(outs).tolist():
        mine = (outs == index) & (cast == 0)
        src, dst, n = source[mine], pieces.output_offset[mine], pieces.nbytes[mine]
        out = outputs[index]
        target = np.frombuffer(out.view, dtype=np.uint8)
        small = n < GATHER_MAX_BYTES
        if small.any():
            _gather(target, source_bytes, src[small], dst[small], n[small])
        for s, d, k in zip(src[~small].tolist(), dst[~small].tolist(), n[~small].tolist()):
            out.view[d:d + k] = whole[s:s + k]
        out.wrote(int(n.sum()))
    for k in np.flatnonzero(cast).tolist():  # casts: one at a time
        s, n = int(source[k]), int(pieces.nbytes[k])
        data = cast_bytes(whole[s:s + n], *pieces.casts[int(cast[k])])
        at, out = int(pieces.output_offset[k]), outputs[int(outs[k])]
        out.view[at:at + len(data)] = data
        out.wrote(len(data))
    del source_bytes, target, whole
    if progress is not None:
        progress(size)


def cast_bytes(data: memoryview, src: str, dst: str) -> memoryview:
    """Elements of dtype `src` as dtype `dst` (torch is imported only here, when a cast is asked)."""
    import warnings

    import torch

    from zeroshard.storage.safetensors_header import torch_dtype

    with warnings.catch_warnings():  # a read-only view of the page cache: only read, never written
        warnings.simplefilter("ignore", UserWarning)
        values = torch.frombuffer(data, dtype=torch_dtype(src)).to(torch_dtype(dst))
    return memoryview(values.view(torch.uint8).numpy())


def check_input(reader: "CheckpointReader", rank: int, whole: memoryview, names) -> None:
    """Check the bytes of an input file mapped whole before its fragments `names` are used.

    A small file is checked with one hash, the manifest's: it covers every byte, header and
    hash table included, so no fragment hash needs computing (a 1,000-rank checkpoint of tiny
    tensors has 300 fragments per file). A bigger one by the hashes of the fragments used only:
    consolidate reads the weights, not the optimizer state beside them. On a mismatch the
    fragment hashes name the tensor when they can."""
    if len(whole) <= WHOLE_HASH_BYTES:
        if hash_bytes(whole) == reader.manifest.file_for_rank(rank).hash:
            return
        names = [n for n in reader.open_file(rank).header.entries]
    recorded = reader.fragment_hashes(rank)
    entries = reader.open_file(rank).header.entries
    for name in names:
        entry = entries[name]
        if name in recorded and hash_bytes(whole[entry.begin:entry.end]) != recorded[name]:
            raise CheckpointError(reader.where(rank),
                                  f"tensor {name!r}: content hash mismatch (file corrupt or modified)")
    if len(whole) <= WHOLE_HASH_BYTES:
        raise CheckpointError(reader.where(rank), "content hash mismatch (file corrupt or modified)")


def _gather(target: np.ndarray, source: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
    """target[dst[i]:dst[i]+nbytes[i]] = source[src[i]:src[i]+nbytes[i]] for every i, at once."""
    total = int(nbytes.sum())
    within = np.arange(total) - np.repeat(np.cumsum(nbytes) - nbytes, nbytes)
    target[np.repeat(dst, nbytes) + within] = source[np.repeat(src, nbytes) + within]
