"""Settings and plumbing shared by concurrent remote reads (read_ahead.py) and uploads (multipart.py).

The settings travel with a Location's storage options under `zeroshard_*` keys (so they can be
given on the command line with `-S zeroshard_read_ahead=4`); they are taken out before the rest
go to fsspec. Requests run as coroutines on fsspec's own event loop when the filesystem is
asynchronous (s3fs, gcsfs...): no threads, and cancelling a request really stops it. Other
filesystems get a small shared thread pool.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from zeroshard.errors import ZeroshardError

if TYPE_CHECKING:  # imported where used (remote folders only): a local command starts faster
    from concurrent.futures import Future, ThreadPoolExecutor

MiB = 1024 * 1024
S3_MIN_PART_BYTES = 5 * MiB  # S3's smallest part, except the last
S3_MAX_PARTS = 10_000


@dataclass(frozen=True)
class RemoteIO:
    """How much a remote file is read and written concurrently.

    Memory: blocks fetched ahead of the reads asked for are at most `read_ahead` (64 MiB by
    default) across all the files read through one Location, and one read holds at most
    `read_ahead` blocks of its own; an upload holds its filling part plus `uploads_in_flight` parts.
    Time: an S3 request that keeps failing is retried for `retry_s`, then the command gives up
    (s3_retry.py).
    """

    block_bytes: int = 8 * MiB  # one ranged GET (AWS advises ranges of 8 or 16 MB)
    read_ahead: int = 8  # GETs in flight for one reader (and blocks held ahead, across its Location)
    part_bytes: int = 16 * MiB  # size of one multipart-upload part (doubles every 2,000 parts)
    uploads_in_flight: int = 8  # parts uploading at once for one object
    retry_s: float = 60.0  # how long an S3 request may keep failing (retried) before the command gives up


# The clean-up of a failed upload (its abort) waits at most this long: a failing command must end.
ABORT_WAIT_S = 15.0


OPTION_KEYS = {
    "zeroshard_block_size": "block_bytes",
    "zeroshard_read_ahead": "read_ahead",
    "zeroshard_part_size": "part_bytes",
    "zeroshard_uploads_in_flight": "uploads_in_flight",
    "zeroshard_retry_s": "retry_s",
}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]i?B?)?\s*$", re.IGNORECASE)


def _size(key: str, value: Any) -> int:
    match = _SIZE.match(str(value))
    if not match:
        raise ZeroshardError(f"storage option {key}={value!r}: expected a byte count such as 16777216 or 16MiB")
    unit = (match.group(2) or "").upper()[:1]
    return int(match.group(1)) * (1024 ** " KMG".index(unit) if unit else 1)


def _seconds(key: str, value: Any) -> float:
    text = str(value).strip().removesuffix("s").strip()
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0.1 <= seconds <= 24 * 3600:  # also refuses nan and inf
        raise ZeroshardError(f"storage option {key}={value!r}: expected seconds between 0.1 and 86400, such as 60")
    return seconds


def split_options(options: Mapping[str, Any]) -> tuple[RemoteIO, dict[str, Any]]:
    """(zeroshard's remote I/O settings, the options left for fsspec)."""
    mine = {OPTION_KEYS[k]: v for k, v in options.items() if k in OPTION_KEYS}
    rest = {k: v for k, v in options.items() if k not in OPTION_KEYS}
    if unknown := [k for k in rest if k.startswith("zeroshard_")]:
        raise ZeroshardError(f"unknown storage option {unknown[0]!r} (known: {', '.join(OPTION_KEYS)})")
    values: dict[str, Any] = {}
    for field, value in mine.items():
        key = next(k for k, f in OPTION_KEYS.items() if f == field)
        if field == "retry_s":
            values[field] = _seconds(key, value)
            continue
        values[field] = _size(key, value)
        low = S3_MIN_PART_BYTES if field == "part_bytes" else 64 * 1024 if field == "block_bytes" else 1
        if values[field] < low:
            raise ZeroshardError(f"storage option {key}={value!r}: must be at least {low}")
    return RemoteIO(**values), rest


def part_size(settings: RemoteIO, part_number: int) -> int:
    """Bytes of part `part_number` (1-based): doubling every 2,000 parts keeps S3's 10,000-part
    limit out of reach (16 MiB parts reach ~1 TB) while small files keep small parts."""
    return settings.part_bytes << min((part_number - 1) // 2000, 4)


class BlockBudget:
    """Blocks held ahead of readers, counted across every reader of one Location, so that
    many files read at once (consolidate reads all ranks in turn) stay within one bound."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.held >= self.limit:
                return False
            self.held += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.held -= 1


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    from concurrent.futures import ThreadPoolExecutor

    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(32, thread_name_prefix="zeroshard-io")
        return _pool


def submit(fs: Any, method: str, *args: Any, **kwargs: Any) -> Future:
    """Start `fs.<method>(*args, **kwargs)` in the background; a concurrent Future of its result.

    On an async filesystem the coroutine `fs._<method>` runs on fsspec's loop (cancel() stops it);
    otherwise the blocking method runs on the shared thread pool (cancel() stops it if not begun).
    """
    if getattr(fs, "async_impl", False) and hasattr(fs, f"_{method}"):
        import asyncio  # only remote folders get here; a local command does not pay its import

        return asyncio.run_coroutine_threadsafe(getattr(fs, f"_{method}")(*args, **kwargs), fs.loop)
    return _thread_pool().submit(getattr(fs, method), *args, **kwargs)
