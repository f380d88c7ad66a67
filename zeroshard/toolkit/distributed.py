"""Reshard or consolidate with many processes on many machines, launched by torchrun.

    torchrun --nnodes 8 --nproc-per-node 16 -m zeroshard.toolkit reshard s3-or-shared/ckpt --to 2048 -o OUT
    torchrun --nnodes 4 --nproc-per-node 8 -m zeroshard.toolkit consolidate CKPT s3://bucket/hf --max-shard-size 5GB

(`python -m zeroshard.toolkit` is the `zeroshard` command, which under torchrun shares the work.)

No scheduler of our own: torchrun starts the processes and a gloo group (over TCP, no GPU)
carries a few small messages. Every process reads the manifest; rank 0 prepares the output;
the output files are dealt out as disjoint tasks (zeroshard.toolkit.transfer), each process
writes its share rank-major and makes it durable; rank 0 commits (manifest or HF index) only
after every process reported success, so a failure anywhere commits nothing. Before anything is
prepared, the processes agree that they were started alike: each sends its normalized arguments
and the digest of the manifest it read, and if any differ all refuse, naming the difference
(processes started with another --to or another checkpoint would otherwise commit a mix). Inputs and the
output folder must be reachable by every process under the same path: a shared filesystem, or an
object store (s3://; `-S key=value` passes storage options as the CLI's does). Into an object
store each process streams whole files, a contiguous band of them (an object is written front to
back by one writer); locally they fill memory-mapped files. One big local consolidated file is
shared by tensor ranges across processes, which needs a filesystem with coherent concurrent
writes to one file (local, Lustre, GPFS): on NFS use --max-shard-size so that each process
writes whole files.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from typing import Any

from zeroshard.agree import agree
from zeroshard.errors import ZeroshardError
from zeroshard.format.folder import read_manifest_bytes, resolve_checkpoint
from zeroshard.format.manifest import MANIFEST_NAME, Manifest, parse_manifest
from zeroshard.format.output import PreparedOutput, output_transaction, prepare_output
from zeroshard.storage.identity import identity
from zeroshard.storage.location import Location
from zeroshard.toolkit.plan import plan_files, plan_rank_files
from zeroshard.toolkit.plans import Finished, carried_tensors
from zeroshard.toolkit.reshard import commit_resharded, target_of
from zeroshard.toolkit.transfer import commit, create_outputs, discard, write_plan


@output_transaction
def reshard_distributed(ckpt: str, world_size: int, out: str, *, overwrite: bool = False,
                        storage_options: dict | None = None, workers: int = 1) -> str:
    """Collective over the default process group: every process calls it; returns OUT's URL."""
    ckpt, out = os.fspath(ckpt), os.fspath(out)  # any os.PathLike
    import torch.distributed as dist

    rank, procs = dist.get_rank(), dist.get_world_size()
    opened: dict[str, Any] = {}

    def setup() -> dict[str, str]:
        given, source, manifest, digest = _open_source(ckpt, storage_options)
        out_root = Location(out, storage_options)
        target = target_of(given, source, out_root)
        opened.update(given=given, source=source, manifest=manifest, out_root=out_root, target=target)
        return _arguments("reshard", given, source, manifest, digest, {
            "--to": world_size, "-o": _where(target), "--overwrite": overwrite, "-j": workers})

    _same_everywhere(_agree(setup))  # before anything is prepared: nothing written if they differ
    given, source, manifest = opened["given"], opened["source"], opened["manifest"]
    out_root, target = opened["out_root"], opened["target"]
    specs = carried_tensors(manifest, world_size)

    prepared: list[PreparedOutput] = []  # process 0's: identity, claim, stage (docs/SAFETY.md)

    def prepare() -> Any:
        prepared.append(prepare_output(target, overwrite, inputs=[given, source]))
        return prepared[0].stage.url, uuid.uuid4().hex

    stage_url, checkpoint_id = _on_rank0(prepare)
    stage = Location(stage_url, storage_options)
    plan = plan_rank_files(manifest, specs, world_size, checkpoint_id)  # every process plans alike, takes its share
    # local: whole files per task, S3: a band of whole files per process; each process syncs its own files
    written = _agree(lambda: write_plan(source, manifest, stage, plan, workers, rank=rank, procs=procs, sync=True))
    results = [result for part in written for result in part]
    _on_rank0(lambda: commit_resharded(prepared[0], manifest, specs, world_size, results, checkpoint_id, out_root))
    return target.url  # (after a failure anywhere, process 0's output_transaction abandons the output)


@output_transaction
def consolidate_distributed(ckpt: str, out: str, *, max_shard_size: str | None = None, dtype: str | None = None,
                            overwrite: bool = False, storage_options: dict | None = None, workers: int = 1,
                            include: list[str] | None = None, exclude: list[str] | None = None,
                            strip_prefix: list[str] | None = None, config: str | None = None) -> list[str]:
    """Collective: every process calls it; rank 0 plans and creates the outputs, all fill them.
    include/exclude/strip_prefix/config: as zeroshard.toolkit.consolidate.consolidate."""
    ckpt, out = os.fspath(ckpt), os.fspath(out)  # any os.PathLike
    import torch.distributed as dist

    from zeroshard.toolkit import consolidate as single

    rank, procs = dist.get_rank(), dist.get_world_size()
    opened: dict[str, Any] = {}

    def setup() -> dict[str, str]:
        given, source, manifest, digest = _open_source(ckpt, storage_options)
        folder, names, shards, total, single_file = single.plan(
            source, manifest, out, dtype=dtype, max_shard_size=max_shard_size, include=include, exclude=exclude,
            strip_prefix=strip_prefix)
        config_bytes = single.model_config(manifest, config, single_file, out)
        opened.update(source=source, manifest=manifest, plan=(folder, names, shards, total, single_file),
                      config=config_bytes)
        size = None if max_shard_size is None else single.parse_size(max_shard_size)
        return _arguments("consolidate", given, source, manifest, digest, {
            "OUT": _where(folder, names[0] if single_file else ""), "--max-shard-size": size, "--dtype": dtype,
            "--overwrite": overwrite, "-j": workers, "--include": include or [], "--exclude": exclude or [],
            "--strip-prefix": strip_prefix or [],  # the config's bytes, not its path: each process reads its own
            "--config": config_bytes and hashlib.sha256(config_bytes).hexdigest()[:16]})

    _same_everywhere(_agree(setup))  # before anything is prepared: nothing written if they differ
    source, manifest = opened["source"], opened["manifest"]
    folder, names, shards, total, single_file = opened["plan"]
    prepared: list[PreparedOutput | None] = []  # process 0's (None for a single file: replaced atomically)
    plan = plan_files(manifest, names, shards)  # every process plans alike, then takes its share
    created: list[Finished] = []

    def create() -> tuple[str, dict[int, str]]:
        prepared.append(single.prepare(folder, names, single_file, overwrite,
                                       [Location(ckpt, storage_options), source]))
        stage = prepared[0].stage if prepared[0] else folder
        if stage.local:  # (an object store has no shared file to fill: each process streams whole files)
            created.extend(create_outputs(stage, plan))
        return stage.url, {i: f.temp_path for i, f in enumerate(created)}

    stage_url, temp_paths = _on_rank0(create)
    stage = Location(stage_url, storage_options)

    def finish() -> None:
        commit(stage, created, durable=True)  # also a file no process wrote into (none on S3)
        if prepared[0] is not None:
            single.finish_folder(prepared[0], names, shards, total, opened["config"])

    try:  # local: all fill process 0's files by runs of pieces, S3: each process a band of whole files
        _agree(lambda: write_plan(source, manifest, stage, plan, workers, temp_paths=temp_paths, rank=rank,
                                  procs=procs, sync=True))
        _on_rank0(finish)
    except BaseException:
        discard(created)  # process 0's (a stage, if any, is abandoned by its output_transaction)
        raise
    return [folder.url_of(name) for name in names] + ([folder.url_of(single.CONFIG_NAME)] if opened["config"] else [])


# ---- agreeing on what to do -------------------------------------------------------------------
def _open_source(ckpt: str, storage_options: dict | None) -> tuple[Location, Location, Manifest, str]:
    """CKPT as given, the checkpoint behind it, its manifest, and the SHA-256 of the manifest's
    bytes (read once: the manifest agreed on is the one used)."""
    given = Location(ckpt, storage_options)
    source = resolve_checkpoint(given)
    raw = read_manifest_bytes(source)
    return given, source, parse_manifest(raw, source.url_of(MANIFEST_NAME)), hashlib.sha256(raw).hexdigest()


def _where(location: Location, name: str = "") -> str:
    """A path as every process should see it: resolved (links, `..`, the working directory)."""
    return ":".join(identity(location, name))


def _arguments(command: str, given: Location, source: Location, manifest: Manifest, digest: str,
               options: dict[str, Any]) -> dict[str, str]:
    """What this process was asked to do, normalized; equal on every process or nobody writes."""
    from zeroshard import __version__

    described = {"command": command, "CKPT": _where(given), "checkpoint folder": _where(source)}
    described.update({flag: str(value) for flag, value in options.items()})
    described.update({"zeroshard version": __version__, "manifest id": manifest.id, "manifest sha256": digest})
    return described


def _same_everywhere(described: list[dict[str, str]]) -> None:
    """Raise the same one-line error on every process if any was started differently from process 0."""
    problems = []
    for rank, mine in enumerate(described[1:], start=1):
        differ = [key for key in described[0] if mine.get(key) != described[0][key]]
        manifest = [key for key in differ if key.startswith("manifest")]
        said = [f"process {rank} was started with {key} {mine.get(key)}, process 0 with {key} {described[0][key]}"
                for key in differ if key not in manifest]
        if manifest:
            key = manifest[0]  # the id when it differs, else the bytes' hash
            said.append(f"process {rank} reads a different checkpoint ({key} {mine[key][:32]} vs "
                        f"{described[0][key][:32]})")
        if said:
            problems.append("; ".join(said))
    if problems:
        more = f" (and {len(problems) - 3} more processes)" if len(problems) > 3 else ""
        raise ZeroshardError("the processes of this run were not started alike, so none writes anything: "
                             + "; ".join(problems[:3]) + more)


def _agree(step) -> list:
    """Run `step` everywhere; every process gets every result, or every process raises
    (zeroshard.agree: the failed process its own error, the others OtherRanksFailedError)."""
    result, error = None, None
    try:
        result = step()
    except ZeroshardError as exc:
        error = exc
    except Exception as exc:  # any failure becomes a one-line error on every process
        error = ZeroshardError(f"{type(exc).__name__}: {exc}")
    return agree(error, action="the distributed toolkit run", payload=result)


def _on_rank0(step) -> Any:
    """Run `step` on process 0 and share its result (or its error) with everyone."""
    import torch.distributed as dist

    return _agree(step if dist.get_rank() == 0 else lambda: None)[0]
