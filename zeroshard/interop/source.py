"""What an import source is: how to recognise its folder, how to read it, and what its
`zeroshard import NAME` subcommand says and takes. Each source module (deepspeed_ckpt.py,
dcp_import.py, megatron.py) holds one `SOURCE`; sources.py lists them. Plain data: no click
here (the CLI makes the command from it) and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from zeroshard.interop.imported import Imported
    from zeroshard.storage.location import Location


@dataclass(frozen=True)
class Option:
    """One option of the import subcommand beyond those every source has (--world, --overwrite,
    -S, -q, --debug). `flags`: the spellings, then the keyword `read` gets it as (click's order)."""

    flags: tuple[str, ...]
    help: str
    kind: str = "value"  # "value" (a string), "int", "flag" (on/off), "lines" (a file of one entry a line)
    metavar: str | None = None


@dataclass(frozen=True)
class Source:
    """One kind of foreign checkpoint `zeroshard import` reads."""

    name: str  # the subcommand (`zeroshard import NAME`), and the tag its output is written with
    label: str  # a few words naming the tool, for the `import` group's help ("DeepSpeed")
    help: str  # the subcommand's help text, as click shows it (first sentence: its one-line summary)
    # What the folder is, in a few words ("a DeepSpeed checkpoint"), when it is this source's;
    # else None. Given the folder and its listing; looks at names and small files only (an
    # error reading one means "not this source": the registry catches it).
    recognise: Callable[["Location", list[str]], str | None]
    read: Callable[..., "Imported"]  # read(src, storage_options=..., **options): the folder, unwritten
    options: tuple[Option, ...] = ()
    world_help: str = "Ranks to write for (default: the source's)."
