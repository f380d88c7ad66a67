"""Writing an output folder without ever losing the old one (see docs/SAFETY.md).

prepare_output() refuses an output that overlaps an input (storage.identity), claims the folder
for this writer (storage.claim), removes leftovers of dead writers there, and picks where the
new files go: straight into the folder when it holds nothing, or, when --overwrite replaces an
existing output, into a hidden staging folder inside it. Until commit the old output is not
touched. commit() then swaps: write the new commit file (manifest or index) and a swap marker
into the stage; remove the old commit file (un-commit); move the new files up (renames locally,
server-side copies on S3); delete what the old output had that the new one does not use; write
the commit file; drop the stage and the claim. From the marker on, stage + folder hold the
whole new output, and the stage is never removed as a leftover.

A command that writes outputs is decorated with @output_transaction: if it raises, every output
it prepared is abandoned (stage removed, claim released) and the old output is left as it was.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar

from zeroshard.errors import OutputExistsError, ZeroshardError
from zeroshard.format.manifest import MANIFEST_NAME, Manifest, is_rank_file_name
from zeroshard.storage.claim import CLAIM_NAME, Claim, take_claim
from zeroshard.storage.identity import check_output_apart
from zeroshard.storage.leftovers import SWAP_MARKER, find_leftovers, remove_leftovers_of_others
from zeroshard.storage.location import Location, is_temp_name

_open_outputs: contextvars.ContextVar[list["PreparedOutput"] | None] = contextvars.ContextVar("zeroshard_outputs",
                                                                                                default=None)
F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class PreparedOutput:
    target: Location  # the output folder
    stage: Location  # where the new files are written: `target` itself, or a hidden folder in it
    previous: list[str]  # visible names in `target` before this run
    claim: Claim | None
    done: bool = field(default=False)
    swapping: bool = field(default=False)  # the old output is un-committed: the stage must survive a failure

    @property
    def staged(self) -> bool:
        return self.stage is not self.target

    def commit_checkpoint(self, manifest: Manifest, sync_files: bool = False) -> None:
        """Commit a checkpoint whose rank files are in the stage: the manifest vouches for them."""
        names = [f.name for f in manifest.files]
        if sync_files:
            self.stage.fsync(names)
        self.commit(names, (MANIFEST_NAME, manifest.to_json()), uncommit=[MANIFEST_NAME],
                    stale=lambda n: is_rank_file_name(n))

    def commit(self, names: Iterable[str], commit_file: tuple[str, bytes] | None, uncommit: Iterable[str],
               stale: Callable[[str], bool]) -> None:
        """Put `names` (written in the stage) in place, then `commit_file` last; delete old files
        matching `stale` that the new output does not use. `uncommit`: old files that vouch for the
        old output, removed before any old file is replaced."""
        if self.claim is not None:
            self.claim.check_held()  # a writer presumed gone never commits over its successor
        names = list(names)
        keep = set(names) | ({commit_file[0]} if commit_file else set())
        if self.staged:
            if commit_file:
                self.stage.write_bytes(*commit_file)  # from here on, stage + target hold the whole new output
            self.stage.write_bytes(SWAP_MARKER, b"swap begun: stage + target hold the new output\n")
            self.swapping = True
            for name in uncommit:
                self.target.remove(name)
            for name in names:
                self.stage.move_into(name, self.target)
        # old files the new output does not use go before the commit: an interrupted swap then
        # leaves exactly the new files here and the commit file in the stage
        for name in self.previous:
            if name not in keep and stale(name):
                self.target.remove(name)
        if commit_file:
            self.target.write_bytes(*commit_file)
        self._finish()

    def abandon(self) -> None:
        """Drop the new files (the old output was never touched) and the claim. Once the swap has
        begun, the stage is kept instead: with the files already moved up it is the new output,
        and `zeroshard clean` reports it rather than removing it. An unstaged output (remote, and
        empty when claimed) has its files written in place without a commit file: they are
        removed, so a failed fresh S3 write leaves nothing behind but what it never wrote."""
        if not self.staged and not self.previous:
            with contextlib.suppress(Exception):  # best effort: without their commit file they are no output
                for name in self.target.list():
                    if name != CLAIM_NAME and not is_temp_name(name):  # a live writer's temps stay
                        self.target.remove(name, recursive=True)
        self._finish(keep_stage=self.swapping)

    def _finish(self, keep_stage: bool = False) -> None:
        if self.staged and not keep_stage:
            with contextlib.suppress(Exception):
                self.target.remove(self.stage.path.rsplit("/", 1)[-1], recursive=True)
        if self.claim is not None:
            self.claim.release()
        self.done = True


def prepare_output(target: Location, overwrite: bool, inputs: Iterable[Location] = (),
                   stage_always: bool = False) -> PreparedOutput:
    """Make `target` ready to receive a new output; refuses one that exists unless `overwrite`.
    A local output is always staged, even into an empty folder: a killed run then leaves only a
    stage and a claim (`zeroshard clean` removes both), never visible files without their commit
    file; moving them up is a rename. Remote outputs are staged only over an existing output (a
    move there is a server-side copy) or with `stage_always` (writers whose files clean could
    not otherwise tell from a finished output's)."""
    check_output_apart(target, list(inputs))
    refuse_file_in_the_way(target)
    claim = take_claim(target)
    try:
        remove_leftovers_of_others(target, claim.took_over)
        existing = [n for n in target.list() if not is_temp_name(n) and n != CLAIM_NAME]
        if existing and not overwrite:
            raise OutputExistsError(target.url)
        staged = existing or stage_always or target.local
        stage = target.child(target.temp_name("stage")) if staged else target
        stage.makedirs()
    except BaseException:
        claim.release()
        raise
    prepared = PreparedOutput(target, stage, existing, claim)
    registry = _open_outputs.get()
    if registry is not None:
        registry.append(prepared)
    return prepared


def prepare_file_output(folder: Location, name: str, overwrite: bool, inputs: Iterable[Location] = ()) -> None:
    """For a one-file output (written atomically, so the old file stays until the new one
    lands): refuse overlap with an input and an existing file unless `overwrite`; remove temp
    files of dead writers of this very name (no claim here: a live writer's are left alone)."""
    check_output_apart(folder, list(inputs), name)
    refuse_file_in_the_way(folder)
    if folder.local and folder.isdir(name):
        raise ZeroshardError(f"{folder.url_of(name)}: exists and is a folder, not a file; pass another output path")
    for leftover in find_leftovers(folder, recursive=False):
        if leftover.kind == "temp file" and leftover.alive is False and leftover.url.endswith("-" + name):
            leftover.remove()
    if folder.exists(name) and not overwrite:
        raise OutputExistsError(folder.url_of(name))


def refuse_file_in_the_way(target: Location) -> None:
    """A local output folder (or a folder above it) that exists as a file is one line naming it,
    not the OS's "File exists" / "Not a directory" from deep inside the claim. (On object stores
    a key and a prefix of the same name coexist: nothing to refuse.)"""
    if not target.local:
        return
    path = target.path
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        where = target.url if path == target.path else path
        raise ZeroshardError(f"{where}: exists and is a file, not a folder; pass another output path")


def output_transaction(fn: F) -> F:
    """Abandon the outputs `fn` prepared (and release their claims) if it raises."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        token = _open_outputs.set([])
        try:
            return fn(*args, **kwargs)
        except BaseException:
            for prepared in _open_outputs.get() or []:
                if not prepared.done:
                    prepared.abandon()
            raise
        finally:
            for prepared in _open_outputs.get() or []:
                if not prepared.done and prepared.claim is not None:
                    prepared.claim.release()
            _open_outputs.reset(token)

    return wrapper  # type: ignore[return-value]
