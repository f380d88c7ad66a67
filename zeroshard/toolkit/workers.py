"""How many workers a toolkit command uses, and of which kind.

Work on big files spends its time in calls that release the GIL (pread, pwrite, XXH3): threads
run it in parallel at no start-up cost. Work on many small files is Python bookkeeping per piece:
that needs processes (spawned: no torch, no fork of a process with threads), each paying a
start-up of a few tenths of a second.

Worker processes die with the process that started them, even when it is SIGKILLed (nothing
of ours runs then): otherwise they would wait forever on a task queue nobody writes to. On
Linux the kernel sends them SIGKILL (prctl PR_SET_PDEATHSIG); elsewhere a thread in each worker
polls its parent. Both check once, after setting up, that the parent is still the one that
started them: one that died during the worker's start-up is not reported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Executor

BIG_FILE_BYTES = 64 * 1024 * 1024  # files this big on average: workers are threads


def auto_workers(files: int, nbytes: int) -> int:
    """--workers' default: every core (up to 8) for a job worth spreading, else this process alone.
    Starting a worker costs a few tenths of a second, about what 1,000 small files cost here: a
    reshard 1,024 -> 1,000 of 20 MB took 1.7 s alone and 2.6 s with 2 workers (2 cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, 8) if files >= 4096 or nbytes >= 256 * 2**20 else 1


def worker_pool(workers: int, file_sizes: list[int]) -> Executor:
    """`workers` threads when the files are big on average, else `workers` spawned processes."""
    if file_sizes and sum(file_sizes) >= BIG_FILE_BYTES * len(file_sizes):
        from concurrent.futures import ThreadPoolExecutor

        return ThreadPoolExecutor(workers, thread_name_prefix="zeroshard-worker")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent, initargs=(os.getpid(),))


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent: int) -> None:
    """Worker initializer: make this process end when `parent` does (see the module docstring).
    PR_SET_PDEATHSIG fires when the thread that spawned us ends, so pools are made and fed from
    a thread that outlives them (toolkit commands: the main thread)."""
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # it died before the kernel was told to watch it
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), name="zeroshard-parent-watch", daemon=True).start()


def _watch_parent(parent: int, every_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)
