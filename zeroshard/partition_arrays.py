"""The partition rule of zeroshard.partition over many tensors at once, as numpy arrays.

Same rule, same results (tests/test_partition.py compares them on random layouts): a reshard of
300 tensors from 1,024 to 1,000 ranks is 600,000 pieces, which a Python loop over
partition.holders spends seconds on. Pure arithmetic: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zeroshard.errors import InvalidArgumentError


def _int64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def chunk_sizes(numel, world_size) -> np.ndarray:
    """partition.chunk_size, element-wise (arguments broadcast)."""
    numel, world = _int64(numel), _int64(world_size)
    if (world < 1).any():
        raise InvalidArgumentError(f"world_size must be >= 1, got {int(world.min())}")
    if (numel < 0).any():
        raise InvalidArgumentError(f"numel must be >= 0, got {int(numel.min())}")
    return -(-numel // world)


def shard_ranges(numel, world_size, rank) -> tuple[np.ndarray, np.ndarray]:
    """partition.shard_range, element-wise: (starts, ends) of `rank`'s elements (arguments broadcast)."""
    numel, rank = _int64(numel), _int64(rank)
    if (rank < 0).any() or (rank >= _int64(world_size)).any():
        raise InvalidArgumentError(f"rank out of range for world_size {world_size}")
    size = chunk_sizes(numel, world_size)
    start = np.minimum(rank * size, numel)
    return start, np.minimum(start + size, numel)


@dataclass
class Overlaps:
    """Row `row[i]`'s range overlaps rank `rank[i]`'s range, which starts at element
    `rank_start[i]`, in elements [lo[i], hi[i]). Ordered by row, then rank."""

    row: np.ndarray
    rank: np.ndarray
    rank_start: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def holders(numel, world_size, start, end) -> Overlaps:
    """partition.holders for many rows at once: for each row, a tensor of `numel[i]` elements
    split over `world_size[i]` ranks (scalars broadcast) and a range [start[i], end[i]) of it,
    every rank whose range overlaps that range. Empty rows yield nothing."""
    numel, chunk, start, end = _rows(numel, world_size, start, end)
    first, count = _spans(chunk, start, end)
    row = np.repeat(np.arange(len(start)), count)
    rank = first[row] + np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    rank_start = rank * chunk[row]
    rank_end = np.minimum(rank_start + chunk[row], numel[row])
    return Overlaps(row, rank, rank_start, np.maximum(start[row], rank_start), np.minimum(end[row], rank_end))


def holder_spans(numel, world_size, start, end) -> tuple[np.ndarray, np.ndarray]:
    """(first, count) per row: the ranks `holders` lists for that row are first .. first + count - 1.
    What a dry run sums, without listing the overlaps (toolkit/plan_summary.py)."""
    _, chunk, start, end = _rows(numel, world_size, start, end)
    return _spans(chunk, start, end)


def _rows(numel, world_size, start, end) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows as holders and holder_spans take them: numel and chunk size per row, the range
    clamped to the tensor."""
    start, end = _int64(start), _int64(end)
    numel = np.broadcast_to(_int64(numel), start.shape)
    chunk = np.broadcast_to(np.maximum(chunk_sizes(numel, world_size), 1), start.shape)
    return numel, chunk, np.maximum(start, 0), np.minimum(end, numel)


def _spans(chunk: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    first = start // chunk
    return first, np.where(end > start, (end - 1) // chunk - first + 1, 0)


def intersect_layouts(numel, source_world: int, target_world: int) -> tuple[np.ndarray, np.ndarray, Overlaps]:
    """Every (tensor, target rank, source rank) overlap of a tensor's layout at `source_world`
    ranks with its layout at `target_world`: returns (tensor, target rank) per overlap and the
    Overlaps (ranks are source ranks), ordered by tensor, target rank, source rank."""
    numel = _int64(numel)
    tensor = np.repeat(np.arange(len(numel)), target_world)
    target = np.tile(np.arange(target_world, dtype=np.int64), len(numel))
    start, end = shard_ranges(numel[tensor], target_world, target)
    found = holders(numel[tensor], source_world, start, end)
    return tensor[found.row], target[found.row], found
