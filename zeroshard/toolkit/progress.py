"""Progress bars for long work: bytes and bytes/s, on stderr, off with --quiet."""

from __future__ import annotations

from tqdm import tqdm


def byte_bar(total: int, description: str, quiet: bool) -> tqdm:
    return tqdm(total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024,
                disable=quiet, leave=False, dynamic_ncols=True)
