"""Telling a lost peer from any other failure, in one place: which ranks went away, on which hosts.

When a node dies, the surviving ranks' next collective fails inside gloo or NCCL ("Connection
closed by peer", "Connection reset", a timeout). `peer_loss_translated(action)` turns that error
into a PeerLostError naming the lost ranks: every surviving rank leaves a mark in the job's
key-value store (the rendezvous store torch.distributed already uses) and waits up to
PROBE_WAIT_S for the others' marks; ranks that leave none are the lost ones. Their host names
come from the table `record_hosts` exchanged once at engine start. When the store itself went
down with the lost node, the error says the ranks could not be learned.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from typing import Any, Iterator

from zeroshard.errors import PeerLostError
from zeroshard.storage.owner import HOST_ID_ENV

# Substrings of gloo / NCCL / c10d errors that mean "the other side went away".
PEER_LOSS_MARKERS = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "timeout",
                     "connection refused", "remote process exited", "communicator was aborted",
                     "socket closed", "no route to host")
PROBE_WAIT_S = 2.0  # the survivors fail within ~0.2 s of each other; a lost rank never answers

_hosts: list[str] = []  # rank -> host name, from record_hosts
_lost: dict[int, str] | None = None  # the probe's answer, once per process (the job is over after it)


def host_name() -> str:
    """This host's name, as peers see it in errors (ZEROSHARD_HOST_ID when set, for tests/containers)."""
    return os.environ.get(HOST_ID_ENV) or os.uname().nodename


def record_hosts(group: Any = None) -> None:
    """Collective: learn every rank's host name (one small all-gather, at engine start)."""
    import torch.distributed as dist

    from zeroshard.exit_drain import drain_gloo_workers_at_exit

    drain_gloo_workers_at_exit()
    names: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, host_name(), group=group)
    _hosts[:] = [str(n) for n in names]


def is_peer_loss(exc: BaseException) -> bool:
    """A torch.distributed error that says another rank went away."""
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in PEER_LOSS_MARKERS)


def lost_ranks() -> dict[int, str]:
    """The ranks that left no mark in the store within PROBE_WAIT_S ({} when that cannot be learned)."""
    global _lost
    if _lost is not None:
        return _lost
    _lost = {}
    with contextlib.suppress(Exception):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=PROBE_WAIT_S))
        prefix = (f"zeroshard-peer-probe/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                  f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
        world, rank = dist.get_world_size(), dist.get_rank()
        store.set(f"{prefix}{rank}", host_name())
        waiting = set(range(world)) - {rank}
        deadline = time.monotonic() + PROBE_WAIT_S
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not store.check([f"{prefix}{r}"])}
            time.sleep(0.05)
        _lost = {r: (_hosts[r] if r < len(_hosts) else "") for r in sorted(waiting)}
    return _lost


@contextlib.contextmanager
def peer_loss_translated(action: str) -> Iterator[None]:
    """Raise a lost peer's library error as PeerLostError (the library's error as its cause)."""
    try:
        yield
    except PeerLostError:
        raise
    except Exception as exc:
        if not is_peer_loss(exc):
            raise
        raise PeerLostError(action, lost_ranks(), f"{type(exc).__name__}: {exc}") from exc
