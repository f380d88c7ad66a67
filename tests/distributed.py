"""Run a function on N local CPU ranks (gloo) and collect each rank's result; never hang.

    from distributed import run_ranks        # tests/ is on sys.path under pytest

    def work(rank, world_size, scale):        # module level, so it pickles by name
        t = torch.ones(1) * rank * scale
        dist.all_reduce(t)
        return t.item()

    assert run_ranks(work, 2, scale=3) == [3.0, 3.0]

Ranks are `spawn`ed worker processes with the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and OMP_NUM_THREADS=1. Importing torch costs seconds per
process on a loaded machine, so workers are kept in a pool per world size and reused: each call
gets a fresh port and, by default, a fresh gloo process group created before `fn` runs and
destroyed after (`init_process_group=False` lets `fn` or `zeroshard.initialize` create it from
the environment). `fresh=True` uses new processes just for that call.

Failure handling is the point: when a rank raises, dies, or `timeout` passes, every rank of
that pool is killed at once (peers may be stuck in a collective) and RankError / RankTimeout
is raised with the failing ranks' tracebacks; the next call starts a new pool. A test that
expects an error should catch it inside `fn` and return it, so the pool survives.
Results travel back as plain pickle bytes.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

__all__ = ["run_ranks", "free_port", "shutdown_pools", "RankError", "RankTimeout"]


class RankError(RuntimeError):
    """A rank raised (or died); the message carries the tracebacks."""


class RankTimeout(RankError):
    """Ranks did not finish within the timeout; all were killed."""


def free_port() -> int:
    """A TCP port that was free a moment ago (good enough for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, tasks: Any, results: Any) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "OMP_NUM_THREADS": "1"})
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5.0)  # unpickling `fn` imports its module (and torch, usually)
        except queue.Empty:
            # A pytest worker that ends without running atexit (xdist's do not always) leaves its pool
            # behind, polling in gloo threads for the rest of the run: a rank outlives its parent by 5 s.
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        task_id, fn, port, init_pg, env, kwargs = task
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        os.environ["MASTER_PORT"] = str(port)
        try:
            if init_pg:
                import torch
                import torch.distributed as dist

                torch.set_num_threads(1)
                # The pg timeout is a backstop; run_ranks' deadline normally fires first.
                dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=300))
            try:
                value = fn(rank, world_size, **kwargs)
            finally:
                dist_mod = sys.modules.get("torch.distributed")
                if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
                    dist_mod.destroy_process_group()
            # Plain pickle bytes: torch's multiprocessing pickler would share tensors through
            # file descriptors that die with this process.
            results.put((task_id, rank, True, pickle.dumps(value)))
        except BaseException:  # report everything, including SystemExit
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.calls = 0
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        end = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        self.kill()


_pools: dict[int, _Pool] = {}
_ids = itertools.count()
# Whatever a test leaks into a rank process (process groups a library keeps alive, each with
# gloo threads polling every 10 ms) would otherwise add up over the whole suite: a pool is
# replaced after this many calls (a fresh one costs a torch import per rank).
RECYCLE_AFTER = 25


def shutdown_pools() -> None:
    """Stop all pooled rank processes (also done at interpreter exit)."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(shutdown_pools)


# See [Note: test tiers] (tests/conftest.py): a default-tier test starts at most this many ranks,
# on the 2-core machine the default command is sized for; conftest names the running test here
# when it is not marked slow.
DEFAULT_TIER_MAX_RANKS = 2
# The exceptions, each with its reason (docs/TESTING.md names them too).
WIDER_IN_THE_DEFAULT_TIER = {
    "tests/test_memory_tier.py::test_a_lost_node_and_the_job_goes_on_with_fewer_ranks_from_the_surviving_copies":
        "the default tier's one node-loss case needs two simulated nodes of two ranks",
}
default_tier_test: str | None = None


def run_ranks(fn: Callable[..., Any], world_size: int, timeout: float = 120, *,
              init_process_group: bool = True, env: dict[str, str] | None = None,
              fresh: bool = False, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` ranks; return the results by rank.

    `fn` and `kwargs` must be picklable (define `fn` at module level). `env` adds environment
    variables for this call. Raises RankError (a rank failed) or RankTimeout (deadline passed);
    either way no rank of this call is left running.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if (default_tier_test is not None and world_size > DEFAULT_TIER_MAX_RANKS
            and default_tier_test not in WIDER_IN_THE_DEFAULT_TIER):
        if os.environ.get("ZEROSHARD_RANKS_LOG"):
            with open(os.environ["ZEROSHARD_RANKS_LOG"], "a") as log:
                log.write(f"{default_tier_test} {world_size}\n")
        else:
            raise RankError(f"{default_tier_test} is in the default tier but starts {world_size} ranks (at most "
                            f"{DEFAULT_TIER_MAX_RANKS}): mark it slow (docs/TESTING.md)")
    try:
        return _call(fn, world_size, timeout, init_process_group, env, fresh, kwargs)
    except RankError as exc:
        # free_port's port was free when chosen, but a neighbour (another xdist worker's rendezvous,
        # a torchrun) can bind it before rank 0 does: that is the harness's race, not the test's
        # failure. One more try on a fresh port and fresh ranks.
        if "EADDRINUSE" not in str(exc) or isinstance(exc, RankTimeout):
            raise
        return _call(fn, world_size, timeout, init_process_group, env, fresh, kwargs)


def _call(fn: Callable[..., Any], world_size: int, timeout: float, init_process_group: bool,
          env: dict[str, str] | None, fresh: bool, kwargs: dict[str, Any]) -> list[Any]:
    pool = _Pool(world_size) if fresh else _pools.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.kill()
        pool = _pools[world_size] = _Pool(world_size)
    task_id = next(_ids)
    port = free_port()
    for q in pool.tasks:
        q.put((task_id, fn, port, init_process_group, dict(env or {}), kwargs))
    done: dict[int, Any] = {}
    ok_pool = False
    try:
        done = _collect(pool, task_id, timeout)
        ok_pool = True
        pool.calls += 1
    finally:
        if fresh:
            pool.close() if ok_pool else pool.kill()
        elif ok_pool and pool.calls >= RECYCLE_AFTER and _pools.get(world_size) is pool:
            del _pools[world_size]
            pool.close()
        elif not ok_pool:
            pool.kill()
            if _pools.get(world_size) is pool:
                del _pools[world_size]
    return [done[r] for r in range(world_size)]


def _collect(pool: _Pool, task_id: int, timeout: float) -> dict[int, Any]:
    world_size = pool.world_size
    done: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    grace_end: float | None = None  # after a failure, collect peers' reports briefly
    while len(done) + len(failures) < world_size:
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if now >= deadline:
            missing = sorted(set(range(world_size)) - set(done) - set(failures))
            raise RankTimeout(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                              f"(all ranks killed)" + _format(failures))
        try:
            tid, rank, ok, value = pool.results.get(timeout=min(0.5, deadline - now))
        except queue.Empty:
            dead = {r: p.exitcode for r, p in enumerate(pool.procs)
                    if p.exitcode is not None and r not in done and r not in failures}
            if dead and grace_end is None:
                failures.update({r: f"process died (exit code {c}) without reporting\n" for r, c in dead.items()})
                grace_end = time.monotonic() + 1.0
            continue
        if tid != task_id:
            continue  # a stale report from an earlier call
        if ok:
            done[rank] = pickle.loads(value)
        else:
            failures[rank] = value
            if grace_end is None:
                # Peers of a failed rank usually fail too ("connection closed"): wait a moment
                # so the report shows the root cause next to them.
                grace_end = time.monotonic() + 1.0
    if failures:
        # A rank that died (killed, os._exit, segfault) never reports: name it next to the
        # peers that failed because of it.
        for r, p in enumerate(pool.procs):
            if r not in done and r not in failures and p.exitcode is not None:
                failures[r] = f"process died (exit code {p.exitcode}) without reporting\n"
        raise RankError(f"{len(failures)} of {world_size} ranks failed" + _format(failures))
    return done


def _format(failures: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
