"""tests/distributed.py itself: results by rank, and failures/hangs end fast with every rank killed.

The failure tests use `fresh=True` (own processes) and pure-Python rank functions with
`init_process_group=False`, so they cost no torch import and do not disturb the shared pools.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from distributed import RankError, RankTimeout, run_ranks

TIER = "mixed"  # docs/TESTING.md


def echo(rank: int, world: int, tag: str) -> tuple[int, int, str, str]:
    return rank, world, tag, os.environ["MASTER_PORT"]


def all_reduce_sum(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def fail_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(600)  # stands for a peer stuck in a collective


def die_on_rank_0(rank: int, world: int) -> None:
    if rank == 0:
        os._exit(3)
    time.sleep(600)


def hang(rank: int, world: int) -> None:
    time.sleep(600)


@pytest.mark.slow
def test_results_come_back_by_rank() -> None:
    results = run_ranks(echo, 3, timeout=60, init_process_group=False, fresh=True, tag="x")
    assert [r[:3] for r in results] == [(0, 3, "x"), (1, 3, "x"), (2, 3, "x")]
    assert len({r[3] for r in results}) == 1


def test_gloo_group_is_ready() -> None:
    assert run_ranks(all_reduce_sum, 2, timeout=120) == [3.0, 3.0]


@pytest.mark.parametrize("fn, kind, words", [
    (fail_on_rank_1, RankError, "ValueError: boom on rank 1"),
    (die_on_rank_0, RankError, "exit code 3"),
    (hang, RankTimeout, "did not finish within 3s"),
])
def test_failures_end_fast_and_kill_every_rank(fn, kind, words) -> None:
    before = set(mp.active_children())
    start = time.monotonic()
    with pytest.raises(kind) as info:
        run_ranks(fn, 2, timeout=3, init_process_group=False, fresh=True)
    assert words in str(info.value)
    assert time.monotonic() - start < 30
    assert [p for p in mp.active_children() if p not in before] == []  # nothing left running
