"""Saving an engine checkpoint: every rank writes its own file at once; rank 0 commits.

    1. every rank streams its file (format v1, local or s3://), durably, hashing as it goes;
    2. the ranks exchange results (file entry + fragment hashes, or the error) on a gloo group
       of their own, so a save can run in a background thread beside training's collectives;
    3. only if every rank succeeded does rank 0 write the manifest (the commit), then move
       `latest`, then prune checkpoints beyond keep_last; the outcome is shared, so a failure
       raises on every rank and never moves `latest`.

Async saves snapshot the rank's state (pinned CPU memory on CUDA) on the caller's thread, then
do 1-3 on a background thread. The next save, wait(), load or interpreter exit joins it; its
failure is raised by that next call.
"""

from __future__ import annotations

import atexit
import datetime
import sys
import threading
import uuid
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zeroshard.checkpointing.collect import LocalState, collect, to_json_value
from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.format import build_manifest, commit_checkpoint, rank_contents, update_latest, write_rank_file
from zeroshard.format.folder import load_manifest
from zeroshard.format.manifest import MANIFEST_NAME, is_safe_file_name
from zeroshard.storage import Location
from zeroshard.storage.claim import Claim, take_claim
from zeroshard.storage.leftovers import remove_leftovers_of_others
from zeroshard.storage.safetensors_header import dtype_name

if TYPE_CHECKING:
    from zeroshard.engine import ZeroEngine


class CheckpointSaveError(ZeroshardError):
    """A save failed on at least one rank; nothing was committed and `latest` did not move."""


class CheckpointSaver:
    """Per-engine save machinery: the coordination group and the background save, if any."""

    def __init__(self, engine: "ZeroEngine", timeout_s: float = 1800.0):
        self.engine = engine
        # gloo whatever the training backend: only small Python objects travel on it
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: dict[str, torch.Tensor] = {}  # async snapshots, reused from save to save
        atexit.register(self._join_at_exit)

    # ---- public ---------------------------------------------------------------------------
    def save(self, path: str, tag: str | None = None, client_state: dict | None = None, *,
             keep_last: int | None = None, async_save: bool = False, lr_scheduler: Any = None,
             storage_options: dict | None = None) -> str:
        """Save; returns the checkpoint's URL (for async saves, where it will be committed)."""
        self.wait()
        engine = self.engine
        tag = tag or f"step-{engine.global_steps:08d}"
        if not is_safe_file_name(tag):
            raise ValueError(f"checkpoint tag {tag!r} must be a plain folder name")
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        root = Location(path, storage_options)
        shared: list[Any] = [None, None, None]
        claim = None
        if engine.rank == 0:
            refusal = None
            try:
                # claim the tag atomically first: of two jobs saving the same tag into one root,
                # exactly one proceeds (docs/SAFETY.md); then refuse a committed one
                if root.is_link(tag):
                    raise CheckpointError(root.url_of(tag), "is a symbolic link; a save writes only inside its root")
                claim = take_claim(root.child(tag), "checkpoint tag")
                if root.child(tag).exists(MANIFEST_NAME):
                    refusal = f"{root.url_of(tag)}: a committed checkpoint with this tag exists"
                else:  # temp files or uploads of an earlier, killed save of this tag
                    remove_leftovers_of_others(root.child(tag))
            except ZeroshardError as exc:
                refusal = str(exc)
            if refusal and claim is not None:
                claim.release()
            shared = [uuid.uuid4().hex, tag, refusal]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        checkpoint_id, tag, refusal = shared
        if refusal:  # checked before any rank writes: an existing checkpoint is never touched
            raise CheckpointSaveError(refusal)
        try:
            if engine.rank == 0:
                client_state = to_json_value(client_state, "client_state") if client_state is not None else None
                scheduler = to_json_value(lr_scheduler.state_dict(), "lr_scheduler state") if lr_scheduler else None
            else:
                client_state = scheduler = None
            local = collect(engine, snapshot=async_save, staging=self._staging)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)  # the pinned snapshot copies have landed
        except BaseException:
            if claim is not None:  # this process lives on: its claim must not block the tag
                claim.release()
            raise
        job = (root, tag, checkpoint_id, local, client_state, scheduler, keep_last, claim)
        if not async_save:
            self._run(*job)
            return root.url_of(tag)
        self._thread = threading.Thread(target=self._run_in_background, args=job, name="zeroshard-save")
        self._thread.start()
        return root.url_of(tag)

    def wait(self) -> None:
        """Block until a background save has finished; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # ---- the protocol -----------------------------------------------------------------------
    def _run_in_background(self, *job: Any) -> None:
        try:
            self._run(*job)
        except BaseException as exc:  # kept for the next call: never swallowed
            self._error = exc

    def _run(self, root: Location, tag: str, checkpoint_id: str, local: LocalState, client_state: Any,
             scheduler: Any, keep_last: int | None, claim: Claim | None) -> None:
        engine = self.engine
        world, rank = engine.world_size, engine.rank
        target = root.child(tag)
        try:
            target.makedirs()
            result: Any = write_rank_file(target, checkpoint_id, rank, world, rank_contents(local.specs, world, rank),
                                          _filler(local))
        except Exception as exc:  # reported to every rank below
            result = f"rank {rank}: {exc}"
        results: list[Any] = [None] * world
        dist.all_gather_object(results, (result, local.python_rng), group=self.group)
        failures = [r for r, _ in results if isinstance(r, str)]
        outcome = None
        if rank == 0:
            try:
                if failures:
                    raise CheckpointSaveError(f"{target.url}: save failed, nothing committed: " + "; ".join(failures))
                manifest = build_manifest(
                    local.specs, world, [r for r, _ in results], checkpoint_id,
                    zero_stage=engine.stage, step=engine.global_steps, tag=tag,
                    dtypes={"compute": dtype_name(engine.compute_dtype), "master": "F32"},
                    optimizer={"class": local.optimizer_class, "param_groups": local.engine_state.get("param_groups"),
                               "scalar_state": local.scalar_state},
                    client_state=client_state, aliases=local.aliases,
                    extra={"engine": {k: v for k, v in local.engine_state.items() if k != "param_groups"},
                           "lr_scheduler": scheduler,
                           "rng": {str(r): py for r, (_, py) in enumerate(results)}},
                )
                commit_checkpoint(target, manifest)
                update_latest(root, tag)
                if keep_last:
                    _prune(root, keep_last, keep=tag)
            except Exception as exc:
                outcome = str(exc) if isinstance(exc, ZeroshardError) else f"{target.url}: {type(exc).__name__}: {exc}"
            finally:
                if claim is not None:
                    claim.release()
        shared = [outcome]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        if shared[0] is not None:
            raise CheckpointSaveError(shared[0])

    def _join_at_exit(self) -> None:
        try:
            self.wait()
        except BaseException as exc:
            print(f"zeroshard: background checkpoint save failed: {exc}", file=sys.stderr)


def _filler(local: LocalState):
    def fill(spec, start: int, end: int, write) -> None:
        held = local.held[spec.name]
        part = held.tensor[start - held.start:end - held.start]
        write(memoryview(part.contiguous().view(torch.uint8).numpy()))
    return fill


def _prune(root: Location, keep_last: int, keep: str) -> None:
    """Delete committed checkpoints beyond the newest `keep_last` (by step, then name).
    Runs only after the new checkpoint committed and `latest` moved to it."""
    committed = []
    for name in root.list():
        folder = root.child(name)
        if root.is_link(name) or folder.is_link(MANIFEST_NAME):
            continue  # a link leads out of the root: what it points at is never ours to delete
        if is_safe_file_name(name) and folder.exists(MANIFEST_NAME):
            try:
                step = load_manifest(folder).step or 0
            except CheckpointError:
                continue  # not ours to judge: leave it
            committed.append((step, name))
    committed.sort()
    doomed = [name for _, name in committed[:-keep_last] if name != keep]
    for name in doomed:
        folder = root.child(name)
        folder.remove(MANIFEST_NAME)  # un-commit first: a half-deleted folder never looks complete
        root.remove(name, recursive=True)
