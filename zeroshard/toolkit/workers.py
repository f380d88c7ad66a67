"""How many processes a toolkit command uses when --workers is not given."""

from __future__ import annotations

import os


def auto_workers(files: int, nbytes: int) -> int:
    """--workers' default: every core (up to 8) for a job worth spreading, else this process alone
    (starting a worker costs a few tenths of a second)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, 8) if files >= 64 or nbytes >= 256 * 2**20 else 1
