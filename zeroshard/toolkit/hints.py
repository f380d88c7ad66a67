"""The next step, appended to a CLI error when the input is something zeroshard can convert or a
user can fix: a DeepSpeed or DCP checkpoint given where a zeroshard one is expected (told apart by
format.folder.foreign_checkpoint_kind, as resolve_checkpoint's own errors do), a pickle given
where safetensors is expected. Looks only at names and a file's first bytes; never raises."""

from __future__ import annotations

import os

from zeroshard.errors import ZeroshardError
from zeroshard.format.folder import foreign_checkpoint_kind
from zeroshard.storage.location import Location, local_path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def next_step(exc: ZeroshardError, storage_options: dict | None = None) -> str | None:
    """A short sentence saying what to do about `exc`, or None when there is nothing to add."""
    where = getattr(exc, "where", None)
    if not isinstance(where, str) or "zeroshard import" in str(exc):  # the reader named the command already
        return None
    try:
        # only where a pickle was taken for safetensors: import's own refusals of pickles say enough
        pickle = _pickle_hint(where) if "safetensors" in str(exc) else None
        return pickle or _checkpoint_hint(where, storage_options)
    except Exception:  # a hint is a courtesy: never replace the real error with another
        return None


def _pickle_hint(where: str) -> str | None:
    path = local_path(where)
    if path is None or not os.path.isfile(path):
        return None
    head = Location(path).read_bytes("", 0, 4)
    if head[:2] == b"PK" or head[:1] == b"\x80" or where.endswith(PICKLE_SUFFIXES):
        return ("this is a pickle (torch.save) file, which zeroshard never reads; convert it to safetensors first, "
                "e.g. safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors') or "
                "transformers' save_pretrained(..., safe_serialization=True)")
    return None


def _checkpoint_hint(where: str, storage_options: dict | None) -> str | None:
    kind = foreign_checkpoint_kind(Location(where, storage_options))
    return f"it looks like {kind[0]}: convert it with `zeroshard import {kind[1]} {kind[2]} OUT`" if kind else None
