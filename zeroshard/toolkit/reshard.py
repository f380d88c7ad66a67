"""`zeroshard reshard`: an N-rank checkpoint into an M-rank one, optimizer state included.

Pure range arithmetic: each output fragment is assembled from the input fragments that overlap
it. Local outputs are written rank-major (zeroshard.toolkit.transfer): each input file read
once, front to back, every piece dropped at its place in memory-mapped outputs, optionally by
several worker processes; many small files are built in memory instead (toolkit.packed). S3
outputs are streamed file by file (toolkit.stream). Inputs are hash-checked on the way in (a small file read whole
by its whole-file hash, else fragment by fragment) and every output fragment is hashed on the way
out. Per-rank ('local') items such as RNG states have no
meaning at a new world size and are dropped (listed in the result).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from zeroshard.errors import ZeroshardError
from zeroshard.format import OpenedCheckpoint, RankFileResult, build_manifest, opened_checkpoint, update_latest
from zeroshard.format.manifest import Manifest, TensorEntry
from zeroshard.format.output import PreparedOutput, output_transaction, prepare_output
from zeroshard.storage.location import Location
from zeroshard.toolkit.plans import RankFilePlans, carried_tensors
from zeroshard.toolkit.progress import byte_bar
from zeroshard.toolkit.transfer import write_plan, write_rank_files
from zeroshard.toolkit.workers import auto_workers


@dataclass
class ReshardResult:
    manifest: Manifest
    location: Location
    dropped: list[str]  # 'local' tensors not carried to the new world size


def default_output(ckpt_url: str, world_size: int) -> str:
    return f"{ckpt_url.rstrip('/')}-world{world_size}"


def target_of(given: Location, source: Location, out_root: Location) -> Location:
    """Where the new checkpoint goes. Given a root (followed through `latest`), a root is written
    too: OUT/<same name> plus OUT/latest, so training resumes from OUT exactly as it would have
    from the original root."""
    return out_root.child(source.url.rstrip("/").rsplit("/", 1)[-1]) if source.url != given.url else out_root


def commit_resharded(output: PreparedOutput, manifest: Manifest, specs: list[TensorEntry], world_size: int,
                     results: list[RankFileResult], checkpoint_id: str, out_root: Location,
                     sync_files: bool = False) -> Manifest:
    """Commit the new checkpoint's manifest (its rank files durable first: `sync_files`, or synced
    by whoever wrote them) and, for a root, OUT/latest. Returns the manifest."""
    extra = dict(manifest.extra, resharded_from={"world_size": manifest.world_size, "checkpoint_id": manifest.id})
    new = build_manifest(specs, world_size, results, checkpoint_id, zero_stage=manifest.zero_stage,
                         dtypes=manifest.dtypes, step=manifest.step, tag=manifest.tag, optimizer=manifest.optimizer,
                         client_state=manifest.client_state, extra=extra, aliases=manifest.aliases)
    output.commit_checkpoint(new, sync_files=sync_files)
    if output.target.url != out_root.url:
        update_latest(out_root, output.target.url.rstrip("/").rsplit("/", 1)[-1])
    return new


@output_transaction
def reshard(ckpt: str | OpenedCheckpoint, world_size: int, out: str | None = None, *, overwrite: bool = False,
            storage_options: dict | None = None, quiet: bool = True, workers: int | None = 1) -> ReshardResult:
    """Rewrite the checkpoint at `ckpt` for `world_size` ranks at `out` (`workers=None`: auto_workers).
    `ckpt`: a path (any os.PathLike), or a checkpoint the caller opened (format.opened_checkpoint)."""
    out = None if out is None else os.fspath(out)
    if world_size < 1:
        raise ZeroshardError(f"--to must be at least 1, got {world_size}")
    if workers is not None and workers < 1:
        raise ZeroshardError(f"--workers must be at least 1, got {workers}")
    opened = opened_checkpoint(ckpt, storage_options)
    given, source, manifest = opened.given, opened.location, opened.manifest
    specs = carried_tensors(manifest, world_size)
    kept = {t.name for t in specs}
    dropped = [name for name in manifest.tensors if name not in kept]
    out_root = Location(out or default_output(given.url, world_size), storage_options)
    target = target_of(given, source, out_root)
    output = prepare_output(target, overwrite, inputs=[given, source])  # identity, claim, stage (docs/SAFETY.md)
    checkpoint_id = uuid.uuid4().hex
    total = sum(t.nbytes for t in specs)
    if workers is None:
        workers = auto_workers(manifest.world_size + world_size, total)
    with byte_bar(total, f"reshard {manifest.world_size} -> {world_size}", quiet) as bar:
        outputs = RankFilePlans(specs, world_size, checkpoint_id)
        if output.stage.local:  # each task plans its own outputs' pieces: bounded at any world size
            results = write_rank_files(source, manifest, output.stage, outputs, workers, bar.update, total)
        else:  # streamed, object by object, from the whole plan (not yet bounded: docs/SCALE.md)
            from zeroshard.toolkit.plan import plan_ranks  # numpy: when a copy starts

            plan = plan_ranks(manifest, outputs, range(world_size))
            results = write_plan(source, manifest, output.stage, plan, workers, bar.update)
    new = commit_resharded(output, manifest, specs, world_size, results, checkpoint_id, out_root, sync_files=True)
    return ReshardResult(new, target, dropped)


def dry_run(ckpt: str | OpenedCheckpoint, world_size: int, out: str | None = None,
            storage_options: dict | None = None) -> str:
    """What `reshard` would read and write, from the manifest alone: nothing is written."""
    from zeroshard.toolkit.plan_summary import describe_reshard  # numpy: only when asked

    if world_size < 1:
        raise ZeroshardError(f"--to must be at least 1, got {world_size}")
    opened = opened_checkpoint(ckpt, storage_options)
    given, source, manifest = opened.given, opened.location, opened.manifest
    out_url = out or default_output(given.url, world_size)
    return (f"dry run: {source.url} ({manifest.world_size} ranks) -> {out_url} ({world_size} ranks); nothing written\n"
            + describe_reshard(manifest, world_size))  # the plan's sums, not its pieces: any scale

