"""Many small fragments, copied with numpy: the tensors x ranks case of rank-major copying.

A consolidate from 1,024 ranks of 300 tensors is 300,000 pieces of a few bytes from 1,024 files;
a Python loop spends microseconds on each piece and a numpy call per file costs more than the
file's bytes. So (zeroshard.toolkit.transfer) local input files of up to 1 MiB are read whole, a
batch of them into one buffer (read_whole, shared with zeroshard.toolkit.packed), each checked
by one hash, and all the batch's pieces are copied with one gather per output and piece size.
Bigger inputs take transfer's per-piece path, where a piece is big enough to pay for itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from zeroshard.errors import CheckpointError
from zeroshard.format.layouts import layouts_of
from zeroshard.storage.hashing import hash_bytes

if TYPE_CHECKING:
    from zeroshard.format.manifest import Manifest
    from zeroshard.format.reader import CheckpointReader
    from zeroshard.storage.location import Location
    from zeroshard.storage.mapped_file import MappedOutput

WHOLE_HASH_BYTES = 1024 * 1024  # inputs up to this size are checked by their whole-file hash
GATHER_MAX_BYTES = 64 * 1024  # larger pieces are copied as slices (an index per unit would cost more)
GATHER_ELEMENTS = 1 << 20  # index arrays built per gather: bounds their memory (~25 MiB)
SAME_SIZE_PIECES = 16  # pieces of a size this many share are moved whole (one memcpy each), not unit by unit
BATCH_BYTES = 16 * 1024 * 1024  # small input files read whole into one buffer of about this size


def copy_small_inputs(source: "Location", manifest: "Manifest", plan: Any, outputs: dict[int, "MappedOutput"],
                      progress: Callable[[int], None] | None, verify: bool) -> Any:
    """Copy the pieces of `plan` that come from local files of up to WHOLE_HASH_BYTES, a batch of
    files at a time; returns the other pieces (bigger files, or a batch with a file read_whole
    would not take: transfer's checked path then reads it, or names what is wrong)."""
    sizes = np.array([f.size for f in manifest.files], dtype=np.int64)
    used = np.bincount(plan.input, minlength=len(sizes)) > 0
    ranks = np.flatnonzero(used & (sizes <= WHOLE_HASH_BYTES))
    ends = np.cumsum(sizes[ranks])
    batches = np.split(ranks, np.flatnonzero(np.diff(ends // BATCH_BYTES)) + 1) if len(ranks) else []
    # each piece's batch, found once (a membership test per batch costs a pass over every piece)
    batch_of = np.full(len(sizes), -1, dtype=np.int64)
    for k, batch in enumerate(batches):
        batch_of[batch] = k
    piece_batch = batch_of[plan.input]
    left = piece_batch < 0
    for k, batch in enumerate(batches):
        mine = piece_batch == k
        read = read_whole(source, manifest, batch, verify)
        if read is None:
            left |= mine
            continue
        pieces = plan.take(mine)
        place(pieces, read[1][pieces.input] + pieces.input_offset, read[0], outputs)
        if progress is not None:
            progress(int(sizes[batch].sum()))
    return plan.take(left)


def read_whole(source: "Location", manifest: "Manifest", ranks: np.ndarray,
               verify: bool = True) -> tuple[bytearray, np.ndarray] | None:
    """Input files `ranks`, each read whole in one call into one buffer (8-aligned, so element
    views line up) and checked with one hash: the manifest's whole-file hash covers every byte,
    header and hash table included. Returns (the buffer, each file's offset in it by rank), or
    None when a file is not as expected (another size, a link, a header other than the one the
    plan's input offsets assume): the caller's general path parses it and says what is off."""
    files = [manifest.file_for_rank(q) for q in ranks.tolist()]
    base = np.cumsum([0] + [-(-f.size // 8) * 8 for f in files])
    buffer = bytearray(int(base[-1]))
    view, layouts = memoryview(buffer), layouts_of(manifest)
    for q, file, at in zip(ranks.tolist(), files, base.tolist()):
        data = view[at:at + file.size]
        if not source.read_whole_into(file.name, data):
            return None
        if verify and hash_bytes(data) != file.hash:
            from zeroshard.format.reader import CheckpointReader

            with CheckpointReader(source, manifest) as reader:  # names the tensor when a fragment hash can
                check_input(reader, q, data, list(reader.open_file(q).header.entries))
                raise CheckpointError(reader.where(q), "content hash mismatch (file corrupt or modified)")
        header = layouts.header(q)
        if file.size != layouts.file_size(q, header) or data[:len(header)].tobytes() != header:
            return None
    offsets = np.zeros(manifest.world_size, dtype=np.int64)
    offsets[ranks] = base[:-1]
    return buffer, offsets


def place(pieces: Any, source: np.ndarray, data, outputs: dict[int, "MappedOutput"]) -> None:
    """Copy each of `pieces` from `data` at `source` (byte offsets, one per piece) into its output."""
    outs, cast = pieces.output, pieces.cast
    for index in np.flatnonzero(np.bincount(outs)).tolist():  # (no sort: a batch has 100,000s of pieces)
        mine = (outs == index) & (cast == 0)
        copy_pieces(outputs[index].view, data, source[mine], pieces.output_offset[mine], pieces.nbytes[mine])
        outputs[index].wrote(int(pieces.nbytes[mine].sum()))
    for k in np.flatnonzero(cast).tolist():  # casts: one at a time
        s, n = int(source[k]), int(pieces.nbytes[k])
        cast_data = cast_bytes(memoryview(data)[s:s + n], *pieces.casts[int(cast[k])])
        at, out = int(pieces.output_offset[k]), outputs[int(outs[k])]
        out.view[at:at + len(cast_data)] = cast_data
        out.wrote(len(cast_data))


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
    """Check the bytes of an input file read whole before its fragments `names` are used.

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
    sizes, counts = np.unique(nbytes, return_counts=True)
    common = sizes[counts >= SAME_SIZE_PIECES]
    for size in common.tolist():  # moved as items of that size: one memcpy each
        same = nbytes == size
        item = np.dtype((np.void, size))
        target = np.ndarray((len(out_buf) - size + 1,), item, out_buf, strides=(1,))
        source = np.ndarray((len(in_buf) - size + 1,), item, in_buf, strides=(1,))
        s, d, step = src[same], dst[same], max(1, GATHER_ELEMENTS * 8 // size)
        for at in range(0, len(s), step):  # the gathered temporary stays under 8 MiB
            target[d[at:at + step]] = source[s[at:at + step]]
    rest = ~np.isin(nbytes, common)
    src, dst, nbytes = src[rest], dst[rest], nbytes[rest]
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
