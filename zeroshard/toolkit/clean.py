"""`zeroshard clean`: list, then remove, what dead writers left under a path: hidden temp files
and staging folders, claims, uncommitted output files (a torn save's rank files) and pending S3
multipart uploads (see storage.leftovers)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from zeroshard.errors import ZeroshardError
from zeroshard.storage.leftovers import Leftover, find_leftovers
from zeroshard.storage.location import Location

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_age(text: str) -> float:
    """'90s', '30m', '1h', '2d', or plain seconds -> seconds."""
    match = _AGE.match(text)
    if not match:
        raise ZeroshardError(f"cannot read age {text!r}: use e.g. 30m, 1h, 2d or seconds")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


@dataclass
class CleanReport:
    stale: list[Leftover] = field(default_factory=list)  # removed, or to remove in a dry run
    kept: list[tuple[Leftover, str]] = field(default_factory=list)  # found but left, and why
    errors: list[str] = field(default_factory=list)  # removals that failed, one line each
    unreadable: list[str] = field(default_factory=list)  # folders not examined (one line each, naming it)


def clean(path: str, *, older_than_s: float = 3600.0, dry_run: bool = True,
          storage_options: dict | None = None) -> CleanReport:
    """Find leftovers under `path`; remove the stale ones unless `dry_run`. A folder below `path`
    that cannot be examined is named in `report.unreadable` and the rest is still cleaned."""
    path = os.fspath(path)  # any os.PathLike
    report = CleanReport()
    for leftover in find_leftovers(Location(path, storage_options), unreadable=report.unreadable):
        if leftover.stale(older_than_s):
            report.stale.append(leftover)
        else:
            why = leftover.keep or ("its writer is still running" if leftover.alive else "younger than the age given")
            report.kept.append((leftover, why))
    if not dry_run:
        for leftover in report.stale:
            try:
                leftover.remove()
            except ZeroshardError as exc:
                report.errors.append(str(exc))
        # a torn save's folder held only what it wrote: when that is all gone, so is the folder
        for folder in {x.url.rsplit("/", 1)[0] for x in report.stale if x.kind == "uncommitted file"}:
            Location(folder, storage_options).remove_if_empty()
    return report
