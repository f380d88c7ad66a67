"""Who owns which elements: the one partition rule shared by the training core and the files.

A tensor is flattened (row-major) and cut into `world_size` contiguous chunks of
`ceil(numel / world_size)` elements; rank r owns chunk r, clipped to the tensor's end. Trailing
ranks may own nothing. Equal chunk sizes are what collectives want (gloo has no uneven
all_gather), so training pads every chunk to `chunk_size` and files store only real elements.

Pure arithmetic: no I/O, no torch, no process group. Reshard and load-time reshard are range
intersections computed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from zeroshard.errors import InvalidArgumentError

Range = tuple[int, int]  # half-open [start, end) in flat element indices


def chunk_size(numel: int, world_size: int) -> int:
    """Elements per rank's (padded) chunk of a tensor of `numel` elements."""
    if world_size < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
    if numel < 0:
        raise InvalidArgumentError(f"numel must be >= 0, got {numel}")
    return -(-numel // world_size)


def shard_range(numel: int, world_size: int, rank: int) -> Range:
    """The flat element range rank `rank` owns; empty (start == end) when it owns nothing."""
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} out of range for world_size {world_size}")
    size = chunk_size(numel, world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def owning_ranks(numel: int, world_size: int) -> tuple[int, int]:
    """(full, nonempty): ranks below `full` own a whole chunk, ranks in [full, nonempty) (at most
    one) own the shorter rest, ranks from `nonempty` on own nothing."""
    if not numel:
        return 0, 0
    size = chunk_size(numel, world_size)
    return numel // size, -(-numel // size)


def rank_ranges(numels: Iterable[int], world_size: int, rank: int) -> list[Range]:
    """shard_range of many tensors for one rank, in one call (a reshard asks tensors x ranks times)."""
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(f"rank {rank} out of range for world_size {world_size}")
    out = []
    for n in numels:
        size = -(-n // world_size)
        start = rank * size if rank * size < n else n
        out.append((start, start + size if start + size < n else n))
    return out


def shard_ranges(numel: int, world_size: int) -> list[Range]:
    """Every rank's range, in rank order. They tile [0, numel) exactly."""
    return [shard_range(numel, world_size, r) for r in range(world_size)]


def holders(numel: int, world_size: int, start: int, end: int) -> list[tuple[int, Range]]:
    """The ranks whose ranges overlap elements [start, end), with their whole ranges, in order.

    O(ranks returned): a reader planning one rank's share of a 2,048-rank checkpoint touches
    only the two or three ranks that hold it, never the whole list.
    """
    size = chunk_size(numel, world_size)
    start, end = max(start, 0), min(end, numel)
    if end <= start:
        return []
    return [(r, (r * size, min((r + 1) * size, numel))) for r in range(start // size, (end - 1) // size + 1)]


def span_overlaps(numel: int, source_world: int, target_world: int, first: int, end: int) -> tuple[int, int, Range]:
    """Target ranks [first, end) of a tensor resharded from `source_world` ranks to `target_world`:
    (pieces, elements, source ranks): how many (target rank, source rank) pairs overlap (the pieces
    a reshard copies), how many elements those targets own, and the source ranks holding them.

    O(log numel) whatever the number of ranks, by two floor sums over the full-chunk targets: a
    dry run sums 100 million pieces this way without listing them (toolkit/plan_summary.py)."""
    size, source = chunk_size(numel, target_world), max(chunk_size(numel, source_world), 1)
    full, nonempty = owning_ranks(numel, target_world)
    first, end = max(first, 0), min(end, nonempty)
    if end <= first:
        return 0, 0, (0, 0)
    count, low = min(end, full) - first, first * size
    pieces = 0
    if count > 0:  # target r owns [r size, r size + size): floor((r size + size - 1) / C) - floor(r size / C) + 1
        pieces = count + floor_sum(count, source, size, low + size - 1) - floor_sum(count, source, size, low)
    if end > full:  # the one target owning the shorter rest
        start = full * size
        pieces += (numel - 1) // source - start // source + 1
    top = min(end * size, numel)
    return pieces, top - low, (low // source, (top - 1) // source + 1)


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """Sum of floor((a i + b) / m) for i in [0, n), for n, a, b >= 0 and m >= 1, in O(log m)
    steps (the Euclid-like reduction; Python integers: no overflow)."""
    total = 0
    while True:
        if a >= m:
            total += n * (n - 1) // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        top = a * n + b
        if top < m:
            return total
        n, b, m, a = top // m, top % m, a, m


def intersect(a: Range, b: Range) -> Range | None:
    """The common part of two ranges, or None when they do not overlap."""
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


@dataclass(frozen=True)
class Piece:
    """`length` elements copied from source `source` (at `source_offset` inside that source's
    range) to `target_offset` inside the target range."""

    source: int
    source_offset: int
    target_offset: int
    length: int


def pieces(target: Range, sources: Sequence[Range]) -> list[Piece]:
    """How to assemble `target` from the `sources` ranges (any order, any sizes).

    Returns the pieces in target order. Raises ValueError when the sources leave part of the
    target uncovered or overlap inside it: a target is assembled from each element exactly once.
    """
    found: list[Piece] = []
    for index, source in enumerate(sources):
        common = intersect(target, source)
        if common is not None:
            found.append(Piece(index, common[0] - source[0], common[0] - target[0], common[1] - common[0]))
    found.sort(key=lambda p: p.target_offset)
    cursor = 0
    for piece in found:
        if piece.target_offset != cursor:
            kind = "overlap" if piece.target_offset < cursor else "gap"
            at = target[0] + min(cursor, piece.target_offset)
            raise InvalidArgumentError(f"sources {kind} at element {at} of range {target}")
        cursor += piece.length
    if cursor != target[1] - target[0]:
        raise InvalidArgumentError(f"sources leave a gap at element {target[0] + cursor} of range {target}")
    return found


def check_tiling(ranges: Iterable[Range], numel: int) -> None:
    """Raise ValueError unless the non-empty `ranges` cover [0, numel) exactly once."""
    nonempty = sorted(r for r in ranges if r[1] > r[0])
    cursor = 0
    for start, end in nonempty:
        if start < 0 or end > numel:
            raise InvalidArgumentError(f"range [{start}, {end}) is outside [0, {numel})")
        if start < cursor:
            raise InvalidArgumentError(f"ranges overlap at element {start}")
        if start > cursor:
            raise InvalidArgumentError(f"elements [{cursor}, {start}) are not covered")
        cursor = end
    if cursor != numel:
        raise InvalidArgumentError(f"elements [{cursor}, {numel}) are not covered")
