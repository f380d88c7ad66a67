"""The import sources, in one list: `zeroshard import NAME`'s subcommands, the hints a foreign
folder gets (consolidate, inspect, verify, reshard, ls) and resolve_checkpoint's errors all ask
here. Each source is one module holding a `SOURCE` (source.py says what it holds).

Adding a source: its module with a SOURCE, one line in SOURCES below, its fixtures and tests,
a row in docs/DEEPSPEED.md's table (docs/ARCHITECTURE.md, "Where to add").

A static list rather than modules registering themselves: its order is detection's order (a
Megatron folder is a DCP folder too, so megatron comes first), one look shows every source,
and nothing is imported until asked: the CLI imports only the source a command names, and a
folder that is ours never imports any.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from zeroshard.errors import InvalidArgumentError, ZeroshardError
from zeroshard.format import folder
from zeroshard.interop.hf_folders import trainer_checkpoints
from zeroshard.interop.source import Source
from zeroshard.storage.location import Location

# name (the `zeroshard import` subcommand) -> the module of zeroshard/interop holding its SOURCE,
# in the order folders are recognised: the first source that claims a folder has it
SOURCES = {
    "deepspeed": "deepspeed_ckpt",
    "megatron": "megatron",
    "dcp": "dcp_import",
}


def source(name: str) -> Source:
    """The source `zeroshard import NAME` reads (its module imported now)."""
    if name not in SOURCES:
        raise InvalidArgumentError(f"no import source {name!r} (known: {', '.join(SOURCES)})")
    return importlib.import_module(f"zeroshard.interop.{SOURCES[name]}").SOURCE


def all_sources() -> list[Source]:
    """Every source, in recognition order."""
    return [source(name) for name in SOURCES]


class Foreign(NamedTuple):
    """A folder some source reads: what it is in words, the source's name, the path to import."""

    what: str
    source: str
    path: str


def what_it_is(src: Source, location: Location, names: list[str]) -> str | None:
    """`src.recognise`, an unreadable small file meaning "not this source"."""
    try:
        return src.recognise(location, names)
    except (OSError, ZeroshardError, ValueError, RecursionError):  # RecursionError: a deeply nested JSON file
        return None


def foreign_checkpoint_kind(location: Location, _depth: int = 0) -> Foreign | None:
    """What `location` is when some source reads it, a folder whose `latest` names one, or an HF
    Trainer run folder (then its newest checkpoint-N); else None. Names and small files only."""
    if not location.exists():
        return None
    names = location.list()
    for src in all_sources():
        what = what_it_is(src, location, names)
        if what:
            return Foreign(what, src.name, location.url)
    runs = trainer_checkpoints(names)
    if runs and _depth == 0:  # a Trainer's output_dir (of any source): its newest checkpoint says what they are
        inner = foreign_checkpoint_kind(location.child(runs[-1]), _depth + 1)
        if inner is not None:
            return Foreign(f"a Hugging Face Trainer run folder of {len(runs)} checkpoint(s), the newest "
                           f"{runs[-1]} being {inner.what}", inner.source, inner.path)
    return None


def foreign_checkpoint_hint(location: Location) -> str | None:
    """What to run when `location` is a foreign checkpoint rather than ours, else None."""
    kind = foreign_checkpoint_kind(location)
    if kind is None:
        return None
    return (f"not a zeroshard checkpoint but {kind.what}: convert it first with "
            f"`zeroshard import {kind.source} {kind.path} OUT`, then use OUT")


folder.describe_foreign_with(foreign_checkpoint_hint)  # See [Note: foreign folders] in format/folder.py
