"""Reshard or consolidate with many processes on many machines, launched by torchrun.

    torchrun --nnodes 8 --nproc-per-node 16 -m zeroshard.toolkit reshard s3-or-shared/ckpt --to 2048 -o OUT
    torchrun --nnodes 4 --nproc-per-node 8 -m zeroshard.toolkit consolidate CKPT OUT --max-shard-size 5GB

No scheduler of our own: torchrun starts the processes and a gloo group (over TCP, no GPU)
carries a few small messages. Every process reads the manifest; rank 0 prepares the output;
the output files are dealt out as disjoint tasks (zeroshard.toolkit.transfer), each process
writes its share rank-major and makes it durable; rank 0 commits (manifest or HF index) only
after every process reported success, so a failure anywhere commits nothing. Inputs and the
output folder must be reachable by every process under the same path (a shared filesystem).
One big consolidated file is shared by tensor ranges across processes, which needs a
filesystem with coherent concurrent writes to one file (local, Lustre, GPFS): on NFS use
--max-shard-size so that each process writes whole files.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from typing import Any

from zeroshard.agree import agree
from zeroshard.errors import ZeroshardError
from zeroshard.format import FileEntry, RankFileResult, build_manifest, open_checkpoint, update_latest
from zeroshard.format.output import PreparedOutput, prepare_output
from zeroshard.storage.location import Location
from zeroshard.storage.mapped_file import MappedOutput
from zeroshard.toolkit.plans import FixedPlans, RankFilePlans, Task, plan_output, split_output, split_tasks
from zeroshard.toolkit.transfer import Job, commit, discard, run_transfer


def reshard_distributed(ckpt: str, world_size: int, out: str, *, overwrite: bool = False,
                        storage_options: dict | None = None, workers: int = 1) -> str:
    """Collective over the default process group: every process calls it; returns OUT's URL."""
    ckpt, out = os.fspath(ckpt), os.fspath(out)  # any os.PathLike
    import torch.distributed as dist

    rank, procs = dist.get_rank(), dist.get_world_size()
    given = Location(ckpt, storage_options)
    source, manifest = open_checkpoint(given)
    as_root = source.url != given.url
    keep_local = world_size == manifest.world_size
    specs = [t for t in manifest.tensors.values() if keep_local or t.layout != "local"]
    out_root = Location(out, storage_options)
    target = out_root.child(source.url.rstrip("/").rsplit("/", 1)[-1]) if as_root else out_root
    if not target.local:
        raise ZeroshardError(f"{target.url}: distributed reshard writes to a shared filesystem path")

    prepared: list[PreparedOutput] = []  # process 0's: identity, claim, stage (docs/SAFETY.md)

    def prepare() -> Any:
        prepared.append(prepare_output(target, overwrite, inputs=[given, source]))
        return prepared[0].stage.url, uuid.uuid4().hex

    stage_url, checkpoint_id = _on_rank0(prepare)
    planner = RankFilePlans(specs, world_size, checkpoint_id)
    job = Job(source.url, source.storage_options, manifest, stage_url, planner)
    mine = split_tasks(planner, manifest.world_size, procs * max(workers, 1))[rank::procs]

    def finish(finished: list[dict]) -> None:
        results = [RankFileResult(FileEntry(f.name, index, f.size, f.file_hash), f.fragment_hashes)
                   for part in finished for index, f in part.items()]
        extra = dict(manifest.extra, resharded_from={"world_size": manifest.world_size, "checkpoint_id": manifest.id})
        new = build_manifest(specs, world_size, results, checkpoint_id, zero_stage=manifest.zero_stage,
                             dtypes=manifest.dtypes, step=manifest.step, tag=manifest.tag, optimizer=manifest.optimizer,
                             client_state=manifest.client_state, extra=extra, aliases=manifest.aliases)
        prepared[0].commit_checkpoint(new)  # every process synced its own files
        if as_root:
            update_latest(out_root, target.url.rstrip("/").rsplit("/", 1)[-1])

    try:
        finished = _agree(lambda: _run_and_sync(job, mine, workers))
        _on_rank0(lambda: finish(finished))
    except BaseException:
        if prepared and not prepared[0].done:
            prepared[0].abandon()
        raise
    return target.url


def consolidate_distributed(ckpt: str, out: str, *, max_shard_size: str | None = None, dtype: str | None = None,
                            overwrite: bool = False, storage_options: dict | None = None,
                            workers: int = 1) -> list[str]:
    """Collective: every process calls it; rank 0 plans and creates the outputs, all fill them."""
    ckpt, out = os.fspath(ckpt), os.fspath(out)  # any os.PathLike
    import torch.distributed as dist

    from zeroshard.toolkit import consolidate as single

    rank, procs = dist.get_rank(), dist.get_world_size()
    source, manifest = open_checkpoint(ckpt, storage_options)
    folder, names, shards, total, single_file = single.plan(source, manifest, out, dtype=dtype,
                                                            max_shard_size=max_shard_size)
    prepared: list[PreparedOutput | None] = []  # process 0's (None for a single file: replaced atomically)
    if not folder.local:
        raise ZeroshardError(f"{folder.url}: distributed consolidate writes to a shared filesystem path")
    plans = [plan_output(name, [(t.name, t.source, 0, t.source.numel, t.dtype, t.source.shape) for t in shard],
                         {"format": "pt"}, hash_table=False)
             for name, shard in zip(names, shards)]

    def create() -> tuple[str, dict[int, str]]:
        prepared.append(single.prepare(folder, names, single_file, overwrite,
                                       [Location(ckpt, storage_options), source]))
        stage = prepared[0].stage if prepared[0] else folder
        outputs = []
        try:
            for plan in plans:
                outputs.append(MappedOutput.create(stage, plan.name, plan.size))
                outputs[-1].view[:len(plan.header)] = plan.header
                outputs[-1].close()
        except BaseException:
            for output in outputs:
                output.discard()
            raise
        return stage.url, {i: o.temp_path for i, o in enumerate(outputs)}

    stage_url, temp_paths = _on_rank0(create)
    job = Job(source.url, source.storage_options, manifest, stage_url, FixedPlans(plans), temp_paths)
    tasks = [task for i, plan in enumerate(plans) for task in split_output(plan, i, manifest.world_size,
                                                                            procs * max(workers, 1))]

    def finish() -> None:
        stage = Location(stage_url, storage_options)
        commit(stage, _finished_stubs(plans, temp_paths))
        stage.fsync(names)
        if prepared[0] is not None:
            single.finish_folder(prepared[0], names, shards, total)

    try:
        _agree(lambda: _run_and_sync(job, tasks[rank::procs], workers))
        _on_rank0(finish)
    except BaseException:
        if rank == 0:
            discard(_finished_stubs(plans, temp_paths))
            if prepared and prepared[0] is not None and not prepared[0].done:
                prepared[0].abandon()
        raise
    return [folder.url_of(name) for name in names]


def _finished_stubs(plans: list, temp_paths: dict[int, str]) -> list:
    from zeroshard.toolkit.transfer import Finished

    return [Finished(plan.name, temp_paths[i], plan.size) for i, plan in enumerate(plans)]


def _run_and_sync(job: Job, tasks: list[Task], workers: int) -> dict:
    """This process's tasks; then its writes made durable, since process 0 commits them."""
    finished = run_transfer(job, tasks, workers)
    touched = {f.temp_path for f in finished.values()} | {job.temp_paths[i] for t in tasks for i in t.outputs
                                                          if i in job.temp_paths}
    for path in touched:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    commit(Location(job.target_url, job.storage_options), finished.values())  # whole files: under their names
    return finished


def _outcome(step) -> tuple[Any, ZeroshardError | None]:
    try:
        return step(), None
    except ZeroshardError as exc:
        return None, exc
    except Exception as exc:  # any failure becomes a one-line error on every process
        return None, ZeroshardError(f"{type(exc).__name__}: {exc}")


def _agree(step) -> list:
    """Run `step` everywhere; every process gets every result, or every process raises
    (zeroshard.agree: the failed process its own error, the others OtherRanksFailedError)."""
    result, error = _outcome(step)
    return agree(error, action="the distributed toolkit run", payload=result)


def _on_rank0(step) -> Any:
    """Run `step` on process 0 and share its result (or its error) with everyone."""
    import torch.distributed as dist

    result, error = _outcome(step) if dist.get_rank() == 0 else (None, None)
    return agree(error, action="the distributed toolkit run", payload=result)[0]


def main(argv: list[str] | None = None) -> int:
    """`torchrun ... -m zeroshard.toolkit reshard|consolidate ...` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m zeroshard.toolkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("reshard")
    p.add_argument("ckpt")
    p.add_argument("--to", type=int, required=True, dest="world_size")
    p.add_argument("-o", "--out", required=True)
    c = sub.add_parser("consolidate")
    c.add_argument("ckpt")
    c.add_argument("out")
    c.add_argument("--max-shard-size")
    c.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    for each in (p, c):
        each.add_argument("--overwrite", action="store_true")
        each.add_argument("-j", "--workers", type=int, default=1, help="processes per torchrun process")
    args = parser.parse_args(argv)

    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    try:
        if args.command == "reshard":
            url = reshard_distributed(args.ckpt, args.world_size, args.out, overwrite=args.overwrite,
                                      workers=args.workers)
            done = f"wrote {url}: {args.world_size} ranks"
        else:
            files = consolidate_distributed(args.ckpt, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
                                            overwrite=args.overwrite, workers=args.workers)
            done = f"wrote {len(files)} file(s) under {args.out}"
        if dist.get_rank() == 0:
            print(done)
        return 0
    except ZeroshardError as exc:
        print(f"zeroshard: error (process {dist.get_rank()}): {exc}", file=sys.stderr)
        return 1
    finally:
        dist.destroy_process_group()
