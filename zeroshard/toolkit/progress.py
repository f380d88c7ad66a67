"""Progress bars for long work: bytes and bytes/s, on stderr, off with --quiet."""

from __future__ import annotations

from typing import Any


class _NoBar:
    """What a quiet command gets: the calls a bar takes, doing nothing (and tqdm not imported)."""

    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def byte_bar(total: int, description: str, quiet: bool) -> Any:
    """A tqdm byte bar, or with `quiet` one that shows nothing."""
    if quiet:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                leave=False, dynamic_ncols=True)
