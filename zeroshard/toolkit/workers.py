"""How many workers a toolkit command uses, and of which kind.

Work on big files spends its time in calls that release the GIL (pread, pwrite, XXH3): threads
run it in parallel at no start-up cost. Work on many small files is Python bookkeeping per piece:
that needs processes (spawned: no torch, no fork of a process with threads), each paying a
start-up of a few tenths of a second.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from concurrent.futures import Executor

BIG_FILE_BYTES = 64 * 1024 * 1024  # files this big on average: workers are threads


def auto_workers(files: int, nbytes: int) -> int:
    """--workers' default: every core (up to 8) for a job worth spreading, else this process alone
    (starting a worker costs a few tenths of a second)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, 8) if files >= 64 or nbytes >= 256 * 2**20 else 1


def worker_pool(workers: int, file_sizes: list[int]) -> Executor:
    """`workers` threads when the files are big on average, else `workers` spawned processes."""
    if file_sizes and sum(file_sizes) >= BIG_FILE_BYTES * len(file_sizes):
        from concurrent.futures import ThreadPoolExecutor

        return ThreadPoolExecutor(workers, thread_name_prefix="zeroshard-worker")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
