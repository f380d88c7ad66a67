"""`zeroshard sign`: verify a checkpoint completely, then sign what was verified (see
format.signature and docs/SAFETY.md). A checkpoint that does not verify is never signed."""

from __future__ import annotations

import os

from zeroshard.errors import CheckpointError
from zeroshard.format.signature import SIGNATURE_NAME, make_signature
from zeroshard.storage.location import Location
from zeroshard.toolkit.verify import verify


def sign(ckpt: str, key: bytes, *, storage_options: dict | None = None, quiet: bool = True) -> str:
    """Write the signature beside the manifest; returns its URL."""
    ckpt = os.fspath(ckpt)  # any os.PathLike
    report = verify(ckpt, storage_options=storage_options, quiet=quiet, sha256=True)
    if not report.ok:
        more = f" (and {len(report.problems) - 1} more)" if len(report.problems) > 1 else ""
        raise CheckpointError(report.location, f"not signed: it does not verify: {report.problems[0]}{more}")
    location = Location(report.location, storage_options)
    location.write_bytes(SIGNATURE_NAME, make_signature(key, report.manifest_bytes, report.sha256))
    return location.url_of(SIGNATURE_NAME)
