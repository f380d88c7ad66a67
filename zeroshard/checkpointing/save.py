"""Saving a checkpoint: every rank writes its own file at once; rank 0 commits.

    1. every rank gathers its contents (no storage is touched yet); the ranks agree
       (zeroshard.agree) on the outcome, the checkpoint id and the sizes of their rank-state
       blobs, so all list the same tensors;
    2. rank 0 claims the tag (docs/SAFETY.md) and refuses a committed one (with `overwrite`, it
       picks a hidden stage in the tag's folder for the new files instead); the ranks agree on
       that before any of them writes a byte, so two jobs saving one tag never mix;
    3. every rank streams its file (local or s3://), durably, hashing as it goes;
    4. the ranks agree on the results (file entries, or the errors); only if every rank
       succeeded does rank 0 write the manifest (the commit; over a committed tag, the swap of
       format.output: the old checkpoint stays whole until then), then move `latest`, then prune
       checkpoints beyond keep_last; the outcome is agreed once more, so a failure raises
       CheckpointSaveError on every rank and never moves `latest`.
Steps 2-4 may run on a background thread (Checkpointer, async saves), on a gloo group of their
own so that they never interleave with training's collectives: what training waits for does no
storage round trip at all (a slow fsync of the claim never reaches the training loop).
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from zeroshard.agree import agree
from zeroshard.checkpointing.contents import RankContents
from zeroshard.errors import (
    CheckpointError,
    CheckpointSaveError,
    ClaimError,
    OtherRanksFailedError,
    PeerLostError,
    ZeroshardError,
)
from zeroshard.format import build_manifest, commit_checkpoint, rank_contents, update_latest, write_rank_file
from zeroshard.format.folder import load_manifest
from zeroshard.format.manifest import MANIFEST_NAME, is_safe_file_name
from zeroshard.format.output import PreparedOutput
from zeroshard.storage import Location
from zeroshard.storage.claim import CLAIM_NAME, Claim, take_claim
from zeroshard.storage.leftovers import remove_leftovers_of_others
from zeroshard.storage.location import is_temp_name

ACTION = "the checkpoint save"


@dataclass
class SaveJob:
    """One save, agreed on by every rank, ready to write."""

    root: Location
    tag: str
    checkpoint_id: str
    rank: int
    world_size: int
    contents: RankContents
    fill: Callable  # the format writer's callback: contents.fill, or a BackgroundSave's
    manifest_extra: dict[str, Any]  # rank 0: stateful states, client state
    client_state: Any
    keep_last: int | None
    # hand each write to a thread while the next bytes are hashed (AtomicWriter's write_behind):
    # only when fill's bytes stay unchanged until its next write, i.e. not when an async save
    # reads live tensors in place (copy-on-write marks a tensor written once fill returns)
    write_behind: bool = False
    # replace a committed checkpoint of this tag (DeepSpeed's behaviour): the new files go to a
    # stage and are swapped in at the commit, so the old checkpoint stays whole until then
    overwrite: bool = False


def claim_tag(root: Location, tag: str, overwrite: bool = False) -> tuple[Claim, str | None]:
    """Rank 0, before anything is written: of two jobs saving one tag into one root exactly one
    proceeds, and a committed checkpoint of this tag is refused (it is never touched). With
    `overwrite` it is kept until the new one commits: returns the name of the hidden stage (in
    the tag's folder) the ranks write to instead, else None (they write into the folder)."""
    if root.is_link(tag):
        raise CheckpointError(root.url_of(tag), "is a symbolic link; a save writes only inside its root")
    target = root.child(tag)
    claim = take_claim(target, "checkpoint tag", job_scoped=True)
    try:
        committed = target.exists(MANIFEST_NAME)
        if committed and not overwrite:
            # a second save at the same step lands on the same default tag: say how to proceed
            raise CheckpointSaveError(f"{root.url_of(tag)}: a committed checkpoint with this tag exists and is never "
                                      f"overwritten; pass another tag (save(path, tag=...)), save into a new root, "
                                      f"pass overwrite=True (it is replaced once the new one commits), or remove "
                                      f"that folder first")
        kept = remove_leftovers_of_others(target, claim.took_over)  # what an earlier, killed or torn save left
        if kept:  # an overwrite's swap was interrupted there: its stage may be the only whole copy of it
            raise CheckpointSaveError(f"{root.url_of(tag)}: an earlier save's swap into place was interrupted and "
                                      f"{kept[0].url} holds its manifest: move that stage's files up and `zeroshard "
                                      f"verify` it, or remove the folder, before saving this tag again")
        stage = target.temp_name("stage") if committed else None
        if stage is not None:
            target.child(stage).makedirs()
    except BaseException:
        claim.release()
        raise
    return claim, stage


def staged_swap(target: Location, stage: str) -> PreparedOutput:
    """Rank 0, at the commit of an overwrite: format.output's swap of the rank files written in
    `target/stage` over the committed checkpoint in `target` (the old manifest goes, the new
    files move up, old rank files the new checkpoint does not use go, the new manifest is
    written, the stage is removed). Its `swapping` says whether it got past the old manifest."""
    previous = [n for n in target.list() if not is_temp_name(n) and n != CLAIM_NAME]
    return PreparedOutput(target, target.child(stage), previous, claim=None)  # the tag's claim is the save's


def agree_on_save(error: BaseException | None, group: Any, payload: Any,
                  abandon: Callable[[], None] | None = None) -> list[Any]:
    """zeroshard.agree, with every failure raised as CheckpointSaveError (on every rank).

    `abandon` runs before the raise when the exchange completed and a rank had failed: then
    every rank that completed it saw that failure, so none commits, and what this rank wrote can
    go. Not when the exchange itself failed here (a lost peer, a broken connection): rank 0 may
    have completed it and committed, and a committed checkpoint must keep every file."""
    try:
        return agree(error, group, action=ACTION, payload=payload)
    except (CheckpointSaveError, PeerLostError) as exc:  # a lost peer is named as such, on every survivor
        if exc is error and abandon is not None:
            abandon()
        raise
    except OtherRanksFailedError as exc:
        if abandon is not None:
            abandon()
        raise CheckpointSaveError(f"nothing committed: {exc}") from None
    except Exception as exc:  # this rank's own failure
        if exc is error and abandon is not None:
            abandon()
        message = str(exc) if isinstance(exc, ZeroshardError) else f"{type(exc).__name__}: {exc}"
        raise CheckpointSaveError(f"nothing committed: {message}") from exc


def new_checkpoint_id() -> str:
    return uuid.uuid4().hex


def write_and_commit(job: SaveJob, group: Any) -> None:
    """Steps 2 to 4 (collective on `group`). When a rank fails to write, every rank removes the
    file it wrote, and the tag's folder goes too if that leaves it empty: a failed save (a full
    disk, often) leaves no rank files to fill the disk again. Only once the ranks agreed on the
    failure (agree_on_save's `abandon`): a rank that lost its peers keeps its file, since rank 0
    may have committed. Once the manifest is written the files are committed and stay, whatever
    fails after. See [Note: torn saves] for what rank 0 does with its claim. With `job.overwrite`
    over a committed tag the ranks write into a stage in the tag's folder, and all of the above
    holds for the stage: the old checkpoint is not touched until rank 0's swap."""
    target = job.root.child(job.tag)
    claim: Claim | None = None
    stage: str | None = None
    swap: PreparedOutput | None = None
    abandoned = False
    settled = False  # rank 0: the save committed, or every rank that goes on knows it failed

    def nothing_written() -> None:
        nonlocal settled
        settled = True

    try:
        error = None
        if job.rank == 0:
            try:
                claim, stage = claim_tag(job.root, job.tag, job.overwrite)
            except Exception as exc:  # another writer, or a committed tag: nobody writes
                error = exc
        stage = agree_on_save(error, group, stage, nothing_written)[0]  # rank 0's
        where = target.child(stage) if stage is not None else target
        try:
            where.makedirs()
            specs = job.contents.specs
            result = write_rank_file(where, job.checkpoint_id, job.rank, job.world_size,
                                     rank_contents(specs, job.world_size, job.rank), job.fill,
                                     write_behind=job.write_behind)
            error = None
        except Exception as exc:  # reported to every rank
            result, error = None, CheckpointSaveError(
                f"{target.url}: save failed, nothing committed: rank {job.rank}: {exc}")
        def abandon() -> None:
            nonlocal abandoned, settled
            abandoned = settled = True
            if result is not None:  # the tag is still claimed: nobody else writes there now
                with contextlib.suppress(Exception):  # the save's own error is the one to report
                    where.remove(result.file.name)

        results = agree_on_save(error, group, result, abandon)
        error = None
        if job.rank == 0:
            try:
                fields = dict(job.contents.manifest_fields)
                fields["extra"] = {**fields.get("extra", {}), **job.manifest_extra}
                manifest = build_manifest(specs, job.world_size, results, job.checkpoint_id, tag=job.tag,
                                          client_state=job.client_state, **fields)
                if claim is not None:
                    claim.check_held()  # a writer presumed gone never commits over its successor
                if stage is None:
                    commit_checkpoint(target, manifest)
                else:
                    swap = staged_swap(target, stage)
                    swap.commit_checkpoint(manifest)
                settled = True
                update_latest(job.root, job.tag)
                if job.keep_last:
                    prune(job.root, job.keep_last, keep=job.tag)
            except Exception as exc:
                error = exc if isinstance(exc, ZeroshardError) else CheckpointSaveError(
                    f"{target.url}: {type(exc).__name__}: {exc}")
                if stage is not None and not settled:
                    error = overwrite_failed(target, stage, swap, error)
                    settled = not (swap is not None and swap.swapping) and drop_stage(target, stage)
        agree_on_save(error, group, None)
    finally:
        if claim is not None:
            if settled:
                claim.release()
            else:
                claim.mark_torn()
        if abandoned:  # whichever rank removes its file last also removes the folder
            if stage is not None:
                target.remove_if_empty(stage)
            job.root.remove_if_empty(job.tag)


def overwrite_failed(target: Location, stage: str, swap: PreparedOutput | None,
                     error: BaseException) -> CheckpointSaveError:
    """Rank 0's commit of an overwrite failed: say which checkpoint the tag's folder now holds."""
    if swap is not None and swap.swapping:  # docs/SAFETY.md, section 2: the window
        return CheckpointSaveError(
            f"{target.url}: the swap of the new checkpoint into place was interrupted ({error}); nothing is lost: "
            f"the new checkpoint is whole in the folder and its stage {stage} (its manifest is there): move the "
            f"stage's files up into {target.url}, then `zeroshard verify` it")
    return CheckpointSaveError(f"{target.url}: save failed, nothing committed; the checkpoint already there is "
                               f"unchanged: {error}")


def drop_stage(target: Location, stage: str) -> bool:
    """Rank 0, when an overwrite fails before its swap began (every rank is done writing):
    remove the stage and the new files in it. True when it is gone."""
    try:
        target.remove(stage, recursive=True)
    except Exception:  # then it is a torn save's leftover, removed later (see the Note below)
        return False
    return True


# [Note: torn saves]
# A save is torn when it stops after ranks may have written, without a commit and without an
# agreed failure: rank 0 lost a peer (a node died), its own commit failed, or it was interrupted.
# Then nobody knows which rank files exist, and no surviving rank may delete them on its own (rank
# 0 may have committed, for all a non-zero rank knows). So rank 0 does not release its claim but
# marks it torn (storage.claim): a writer is no longer blocked by it, and it tells whose the rank
# files beside it are. They go at the next save of that tag (claim_tag: at any world size, none of
# the old files stays beside the new), at the next pruning (keep_last), or with `zeroshard clean`.
# When rank 0 itself dies, its claim stays unmarked; the claim rules (docs/SAFETY.md, section 3)
# decide when it may be taken over, and its files then go the same ways.


def prune(root: Location, keep_last: int, keep: str) -> None:
    """Delete committed checkpoints beyond the newest `keep_last` (by step, then name), and the
    files of torn saves ([Note: torn saves]). Runs only after the new checkpoint committed and
    `latest` moved to it."""
    committed = []
    for name in root.list():
        folder = root.child(name)
        if root.is_link(name) or folder.is_link(MANIFEST_NAME):
            continue  # a link leads out of the root: what it points at is never ours to delete
        if not is_safe_file_name(name):
            continue
        if folder.exists(MANIFEST_NAME):
            try:
                step = load_manifest(folder).step or 0
            except CheckpointError:
                continue  # not ours to judge: leave it
            committed.append((step, name))
        elif name != keep and folder.exists(CLAIM_NAME):
            remove_torn_save(root, name)  # only where its writer is known to be gone
    committed.sort()
    doomed = [name for _, name in committed[:-keep_last] if name != keep]
    for name in doomed:
        folder = root.child(name)
        folder.remove(MANIFEST_NAME)  # un-commit first: a half-deleted folder never looks complete
        root.remove(name, recursive=True)


def remove_torn_save(root: Location, tag: str) -> None:
    """Remove what a torn save left in `root/tag`. Its claim is taken as a new save's would be:
    a claim marked torn, or one whose writer is known to be gone (the claim rules, docs/SAFETY.md);
    a live or unproven writer's is left alone (ClaimError), and so is anything in the folder that is
    not a zeroshard writer's leftover, and the folder then."""
    with contextlib.suppress(ClaimError):
        claim = take_claim(root.child(tag), "checkpoint tag", job_scoped=True)
        try:
            if not root.child(tag).exists(MANIFEST_NAME):
                remove_leftovers_of_others(root.child(tag), claim.took_over)
        finally:
            claim.release()
        root.remove_if_empty(tag)
