"""The one bucket planner: consecutive items grouped under a size budget (pure arithmetic).

Used for the engine's gradient reduce-scatter buckets, its parameter all-gather buckets and
the toolkit's `--max-shard-size` output files. The rule is Hugging Face's greedy split, which
DeepSpeed's and DDP's bucketing also follow: fill a group until the next item would take it over
`limit`; an item larger than `limit` gets a group of its own. Order is kept, so every rank that
plans the same items gets the same groups.
"""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

T = TypeVar("T")


def greedy_groups(items: Iterable[T], size_of: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive groups of `items` whose sizes add up to at most `limit` (a single item may exceed it)."""
    groups: list[list[T]] = []
    used = 0
    for item in items:
        size = size_of(item)
        if not groups or (groups[-1] and used + size > limit):
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += size
    return groups
