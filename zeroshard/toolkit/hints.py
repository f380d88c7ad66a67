"""The next step, appended to a CLI error when the input is something zeroshard can convert or a
user can fix: another tool's checkpoint given where a zeroshard one is expected (told apart by
the import sources, interop/sources.py, as resolve_checkpoint's own errors are), a pickle given
where safetensors or a checkpoint is expected (shard reads torch.save's zip format). Looks only
at names, small files and a file's first bytes; never raises."""

from __future__ import annotations

import os

from zeroshard.errors import ZeroshardError
from zeroshard.interop.sources import foreign_checkpoint_kind
from zeroshard.storage.location import Location, local_path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def next_step(exc: ZeroshardError, storage_options: dict | None = None) -> str | None:
    """A short sentence saying what to do about `exc`, or None when there is nothing to add."""
    where = getattr(exc, "where", None)
    if not isinstance(where, str) or "zeroshard import" in str(exc):  # the reader named the command already
        return None
    try:
        # only where a pickle was taken for safetensors or a checkpoint: import's own refusals of pickles say enough
        taken = "safetensors" in str(exc) or "not a zeroshard checkpoint" in str(exc)
        pickle = _pickle_hint(where) if taken else None
        return pickle or _checkpoint_hint(where, storage_options)
    except Exception:  # a hint is a courtesy: never replace the real error with another
        return None


def _pickle_hint(where: str) -> str | None:
    path = local_path(where)
    if path is None or not os.path.isfile(path):
        return None
    head = Location(path).read_bytes("", 0, 4)
    if head[:2] == b"PK":
        return (f"this is a torch.save file: `zeroshard shard {where} OUT --world N` reads it (its pickle through a "
                "closed allowlist, never run), as does load_pretrained; the other commands take zeroshard checkpoints")
    if head[:1] == b"\x80" or where.endswith(PICKLE_SUFFIXES):
        return ("this is a pickle in torch's legacy (before 1.6) format or a plain pickle, which zeroshard does not "
                "read: torch.save the state dict again with a current torch, then `zeroshard shard` it")
    return None


def _checkpoint_hint(where: str, storage_options: dict | None) -> str | None:
    kind = foreign_checkpoint_kind(Location(where, storage_options))
    return f"it looks like {kind[0]}: convert it with `zeroshard import {kind[1]} {kind[2]} OUT`" if kind else None
