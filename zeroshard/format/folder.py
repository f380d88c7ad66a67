"""Checkpoint folders: finding the checkpoint behind a path, committing one, moving `latest`.

A checkpoint exists only once its manifest exists: writers put every rank file in place first
and the manifest last (atomically), so a crash at any moment leaves either the previous state
or a complete checkpoint. A root holding several checkpoints names the newest committed one in
a `latest` file, which moves only after that commit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from zeroshard.errors import CheckpointError, InvalidArgumentError
from zeroshard.format.manifest import (
    LATEST_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    is_rank_file_name,
    is_safe_file_name,
    parse_manifest,
)
from zeroshard.storage.location import Location, is_temp_name


def resolve_checkpoint(location: Location) -> Location:
    """The checkpoint folder a user path means: itself if it holds a manifest, else what its
    `latest` names. Errors say what was found instead."""
    if location.exists(MANIFEST_NAME):
        _refuse_link(location, MANIFEST_NAME)
        return location
    if location.exists(LATEST_NAME):
        _refuse_link(location, LATEST_NAME)
        raw = location.read_bytes(LATEST_NAME, 0, MAX_LATEST_BYTES + 1)
        if len(raw) > MAX_LATEST_BYTES:
            raise CheckpointError(location.url_of(LATEST_NAME),
                                  f"is over {MAX_LATEST_BYTES} bytes: not a checkpoint name (starts {raw[:32]!r})")
        name = raw.decode("utf-8", "replace").strip()
        if not is_safe_file_name(name):
            raise CheckpointError(location.url_of(LATEST_NAME),
                                  f"names {name[:64]!r}{'...' if len(name) > 64 else ''}, "
                                  f"which is not a folder inside {location.url}")
        _refuse_link(location, name)
        target = location.child(name)
        if not target.exists(MANIFEST_NAME):
            hint = foreign_checkpoint_hint(location)
            raise CheckpointError(target.url if not hint else location.url,
                                  hint or f"named by {LATEST_NAME} but holds no {MANIFEST_NAME}")
        return target
    if not location.exists():
        raise CheckpointError(location.url, "no such checkpoint (path does not exist)")
    hint = foreign_checkpoint_hint(location)
    if hint:
        raise CheckpointError(location.url, hint)
    rank_files = [n for n in location.list() if is_rank_file_name(n)]
    if rank_files:
        raise CheckpointError(location.url, f"incomplete checkpoint: {len(rank_files)} rank files but no "
                                            f"{MANIFEST_NAME} (the save never committed)")
    raise CheckpointError(location.url, f"not a zeroshard checkpoint: neither {MANIFEST_NAME} nor {LATEST_NAME} found")


MAX_LATEST_BYTES = 4096  # a folder name and a newline; anything longer is not a `latest` file


# [Note: foreign folders]
# format knows no other tool's file names. What a folder that is not ours is (a DeepSpeed save,
# a DCP folder, ...) is told by the describer interop/sources.py installs here when it is
# imported, which the toolkit and interop packages do: resolve_checkpoint's errors then name
# the `zeroshard import` command to run. With none installed they say only what is missing.
_describe_foreign: Callable[[Location], str | None] | None = None


def describe_foreign_with(describe: Callable[[Location], str | None]) -> None:
    """Install `describe(folder)`: a sentence saying what to run for a foreign folder, else None."""
    global _describe_foreign
    _describe_foreign = describe


def foreign_checkpoint_hint(location: Location) -> str | None:
    """What to run when `location` is another tool's checkpoint rather than ours, else None."""
    return _describe_foreign(location) if _describe_foreign is not None else None


def _refuse_link(location: Location, name: str) -> None:
    """Links are never followed out of a checkpoint or root: what they point at is not ours."""
    if location.is_link(name):
        raise CheckpointError(location.url_of(name), "is a symbolic link; zeroshard does not follow links inside a "
                                                     "checkpoint or root (point at the real path instead)")


def read_manifest_bytes(location: Location) -> bytes:
    """The manifest's bytes; one over MAX_MANIFEST_BYTES is refused before it is read whole. An
    object store is asked once, with a ranged GET of at most one byte more than the limit: asking
    its size first, then s3fs's own look before a whole-object GET, were two more round trips."""
    where = location.url_of(MANIFEST_NAME)
    if location.local:
        size = location.size(MANIFEST_NAME)
        if size > MAX_MANIFEST_BYTES:
            raise CheckpointError(where, f"manifest of {size} bytes is over the {MAX_MANIFEST_BYTES} byte limit")
        return location.read_bytes(MANIFEST_NAME)
    data = location.read_bytes(MANIFEST_NAME, 0, MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(where, f"manifest of more than {MAX_MANIFEST_BYTES} bytes is over the byte limit")
    return data


def load_manifest(location: Location) -> Manifest:
    """Parse and validate the manifest of a (resolved) checkpoint folder."""
    return parse_manifest(read_manifest_bytes(location), location.url_of(MANIFEST_NAME))


def open_checkpoint(url_or_location: str | Location, storage_options: dict | None = None) -> tuple[Location, Manifest]:
    """Resolve a user path to a checkpoint folder and load its manifest."""
    location = url_or_location if isinstance(url_or_location, Location) else Location(url_or_location, storage_options)
    resolved = resolve_checkpoint(location)
    return resolved, load_manifest(resolved)


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A path as the user gave it, the checkpoint folder it leads to, and that folder's manifest,
    read once. The command line opens its input once and hands this to the command, so that its
    checks, the command and its closing line see the same checkpoint (a `latest` moved by a save
    in between cannot make them disagree) and the manifest is fetched and parsed once: ~40 ms at
    1,024 ranks, and 2 of a small S3 command's ~50 requests."""

    given: Location
    location: Location
    manifest: Manifest

    def describe(self) -> str:
        """'FOLDER (step N, world W)', as a command's closing line names its input."""
        step = f"step {self.manifest.step}, " if self.manifest.step is not None else ""
        return f"{self.location.url} ({step}world {self.manifest.world_size})"


def opened_checkpoint(ckpt: "str | os.PathLike[str] | OpenedCheckpoint",
                      storage_options: dict | None = None) -> OpenedCheckpoint:
    """`ckpt` opened (resolved, its manifest read and checked), or `ckpt` itself if it already is."""
    if isinstance(ckpt, OpenedCheckpoint):
        return ckpt
    given = Location(os.fspath(ckpt), storage_options)
    location, manifest = open_checkpoint(given)
    return OpenedCheckpoint(given, location, manifest)


def commit_checkpoint(location: Location, manifest: Manifest, previous_names: list[str] = (),
                      sync_files: bool = False) -> None:
    """Write the manifest (the commit), then delete files of an overwritten checkpoint that
    the new one does not use. sync_files: first fsync rank files written with durable=False."""
    if sync_files:
        location.fsync([f.name for f in manifest.files])
    location.write_bytes(MANIFEST_NAME, manifest.to_json())
    keep = {f.name for f in manifest.files} | {MANIFEST_NAME}
    for name in previous_names:
        if name not in keep and (is_rank_file_name(name) or is_temp_name(name)):
            location.remove(name)


def update_latest(root: Location, checkpoint_name: str) -> None:
    """Point `root/latest` at `checkpoint_name` (a committed checkpoint folder inside root)."""
    if not is_safe_file_name(checkpoint_name):
        raise InvalidArgumentError(f"checkpoint name {checkpoint_name!r} is not a plain folder name")
    root.write_bytes(LATEST_NAME, (checkpoint_name + "\n").encode())
