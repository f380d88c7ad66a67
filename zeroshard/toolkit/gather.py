"""Many small fragments, copied with numpy: the tensors x ranks case of rank-major copying.

A reshard of 300 tensors from 1,024 to 1,000 ranks is about 600,000 pieces of a few bytes each. A
Python loop spends microseconds on each; here a plan's pieces (zeroshard.toolkit.plan) are
copied with one gather per (input file, output file) pair. Used by zeroshard.toolkit.transfer
for pieces copied without a dtype cast from small local input files; everything else takes the
per-piece path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from zeroshard.errors import CheckpointError
from zeroshard.storage.hashing import hash_bytes

if TYPE_CHECKING:
    from zeroshard.format.reader import CheckpointReader
    from zeroshard.storage.mapped_file import MappedOutput

WHOLE_HASH_BYTES = 1024 * 1024  # inputs up to this size are checked by their whole-file hash
GATHER_MAX_BYTES = 64 * 1024  # larger pieces are copied as slices (an index per unit would cost more)
GATHER_ELEMENTS = 1 << 20  # index arrays built per gather: bounds their memory (~25 MiB)


def by_input(plan: Any) -> list[tuple[Any, int]]:
    """A zeroshard.toolkit.plan.Plan's pieces in groups of one input file each (sorted by tensor),
    with its rank. (Plan is not imported: plan -> selection -> load -> gather would be a circle.)"""
    plan = plan.take(np.lexsort((plan.tensor, plan.input)))
    starts = np.flatnonzero(np.r_[True, plan.input[1:] != plan.input[:-1]]) if len(plan) else []
    return [(plan.take(slice(a, b)), int(plan.input[a])) for a, b in zip(starts, [*starts[1:], len(plan)])]


def copy_from_input(reader: "CheckpointReader", rank: int, pieces: Any, outputs: dict[int, "MappedOutput"],
                    progress: Callable[[int], None] | None) -> None:
    """Copy `pieces` (all from `rank`'s file, which must be local and mapped whole)."""
    opened = reader.open_file(rank)
    size = opened.header.file_size
    whole = opened.reader.view(0, size)
    tids = pieces.tensor
    unique = np.unique(tids)
    names = [pieces.tensor_names[tid] for tid in unique.tolist()]
    if reader.verify_hashes:
        check_input(reader, rank, whole, names)
    begins = np.array([opened.header.entries[name].begin for name in names], dtype=np.int64)
    # the fragment's place as read in the header, plus the piece's offset inside it
    source = begins[np.searchsorted(unique, tids)] + pieces.input_offset - pieces.input_fragment
    outs, cast = pieces.output, pieces.cast
    for index in np.unique(outs).tolist():
        mine = (outs == index) & (cast == 0)
        copy_pieces(outputs[index].view, whole, source[mine], pieces.output_offset[mine], pieces.nbytes[mine])
        outputs[index].wrote(int(pieces.nbytes[mine].sum()))
    for k in np.flatnonzero(cast).tolist():  # casts: one at a time
        s, n = int(source[k]), int(pieces.nbytes[k])
        data = cast_bytes(whole[s:s + n], *pieces.casts[int(cast[k])])
        at, out = int(pieces.output_offset[k]), outputs[int(outs[k])]
        out.view[at:at + len(data)] = data
        out.wrote(len(data))
    del whole
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


def copy_pieces(out_buf, in_buf, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
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
