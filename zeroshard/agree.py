"""Agreeing on failures across processes: the one routine every collective operation uses.

A rank that fails before a collective must not leave the others waiting in it, and a rank that
did not fail must not carry on as if all was well. So every multi-rank operation (engine
set-up, checkpoint save and load, the toolkit's torchrun mode) ends its fallible local part with
`agree(error, group)`: one all-gather of each rank's outcome, after which every rank raises:
the failed rank its own error, the others an OtherRanksFailedError naming the failed ranks.
A rank that went away altogether (a dead node) makes the exchange itself fail: that is raised
as PeerLostError naming the lost ranks (zeroshard/peers.py).
"""

from __future__ import annotations

from typing import Any

from zeroshard.errors import OtherRanksFailedError, ZeroshardError
from zeroshard.exit_drain import drain_gloo_workers_at_exit
from zeroshard.peers import peer_loss_translated


def agree(error: BaseException | None, group: Any = None, *, action: str, payload: Any = None) -> list[Any]:
    """All-gather `(failed?, message, payload)` on `group`; raise on every rank if any rank failed.

    Returns every rank's `payload` (a small picklable value; in rank order) when all succeeded.
    `action` names the operation in the message others see ("the checkpoint save").
    """
    import torch.distributed as dist  # the toolkit imports this module without needing torch

    drain_gloo_workers_at_exit()

    message = (None if error is None else str(error) if isinstance(error, ZeroshardError)
               else f"{type(error).__name__}: {error}")
    outcome = (message, payload if error is None else None)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    with peer_loss_translated(action):
        dist.all_gather_object(everyone, outcome, group=group)
    if error is not None:
        raise error
    failed = {rank: message for rank, (message, _) in enumerate(everyone) if message is not None}
    if failed:
        raise OtherRanksFailedError(action, failed)
    return [p for _, p in everyone]


def gather_all(value: Any, group: Any = None, *, action: str) -> list[Any]:
    """Every rank's `value` (small, picklable), in rank order; for a second exchange that every
    rank makes because all learned the same thing from the first (so none is left waiting)."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size(group)
    with peer_loss_translated(action):
        dist.all_gather_object(everyone, value, group=group)
    return everyone


def rank_groups(values: list[Any]) -> list[tuple[list[int], Any]]:
    """Ranks grouped by equal value, in order of each group's lowest rank (rank 0's group first)."""
    groups: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return [(ranks, values[ranks[0]]) for ranks in groups.values()]


def ranks_text(ranks: list[int], shown: int = 8) -> str:
    """'rank 3', 'ranks 1, 2', 'ranks 0, 1, ... and 40 more': short at thousands of ranks."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    listed = ", ".join(map(str, ranks[:shown]))
    return f"ranks {listed}" + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")
