"""The `zeroshard` command: shard, reshard, consolidate, inspect, verify (and estimate).

Every path may be local or s3://. Errors are one line naming the file and the problem, with a
non-zero exit; --debug shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator

import click

from zeroshard import __version__
from zeroshard.errors import ZeroshardError

if TYPE_CHECKING:
    from zeroshard.format import OpenedCheckpoint

EXIT_ERROR = 1
EXIT_VERIFY_FAILED = 3

def _common(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--storage-option, --quiet and --debug, and the one-line error handling, for every command."""

    @click.option("-S", "--storage-option", "storage_option", multiple=True, metavar="KEY=VALUE",
                  help="fsspec/s3fs option (repeatable); values are JSON-decoded when they parse.")
    @click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
    @click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
    @functools.wraps(fn)
    def wrapper(storage_option: tuple[str, ...], quiet: bool, debug: bool, **kwargs: Any) -> Any:
        options: dict = {}
        try:
            from zeroshard.storage import parse_storage_options

            options = parse_storage_options(storage_option)
            return fn(storage_options=options, quiet=quiet, **kwargs)
        except (ZeroshardError, ValueError) as exc:
            if debug:
                raise
            hint = None
            ctx = click.get_current_context(silent=True)
            importing = ctx is not None and " import " in f" {ctx.command_path} "  # already converting it
            if isinstance(exc, ZeroshardError) and not importing:  # what to do next (a DeepSpeed folder...)
                from zeroshard.toolkit.hints import next_step

                hint = next_step(exc, options)
            process = f" (process {_process_rank})" if _process_rank is not None else ""  # torchrun mode
            click.echo(f"zeroshard: error{process}: {exc}" + (f"; {hint}" if hint else ""), err=True)
            sys.exit(EXIT_ERROR)
        except KeyboardInterrupt:
            click.echo("zeroshard: interrupted; nothing was committed", err=True)
            sys.exit(130)
        except Exception as exc:  # a bug, or a library error we failed to translate
            if debug:
                raise
            click.echo(f"zeroshard: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)",
                       err=True)
            sys.exit(EXIT_ERROR)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="zeroshard")
def main() -> None:
    """zeroshard: sharded training checkpoints you can reshard, consolidate and verify anywhere.

    \b
    A checkpoint is a folder: one safetensors file per rank plus zeroshard.json, the manifest
    written last (a checkpoint without it never committed). A folder holding several checkpoints
    has a `latest` file naming the newest; commands given that folder follow it.

    \b
    Typical use:
      zeroshard inspect ckpt/                      what is in it
      zeroshard verify ckpt/                       every byte where it should be, hashes match
      zeroshard reshard ckpt/ --to 16 -o ckpt16/   resume on 16 ranks instead of 8
      zeroshard consolidate ckpt/ model.safetensors --dtype bf16
      zeroshard shard model.safetensors ckpt/ --world 8   start a ZeRO run from weights
      zeroshard estimate --params 7.5B --gpus 64   per-GPU model-state memory by ZeRO stage

    \b
    Paths may be local or s3://bucket/prefix. S3 endpoint and credentials come the standard
    way (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_PROFILE, ...) or as
    --storage-option key=value pairs passed to fsspec/s3fs
    (e.g. -S endpoint_url=http://127.0.0.1:9000 -S anon=true).
    """


@main.command()
@click.argument("src")
@click.argument("out")
@click.option("--world", "--to", "world_size", type=int, required=True, help="Number of ranks to shard for.")
@click.option("--strip-prefix", multiple=True, metavar="PREFIX",
              help="Remove PREFIX from the start of tensor names (repeatable; the first that matches), e.g. "
                   "DDP's 'module.' or torch.compile's '_orig_mod.'.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@_common
def shard(src: str, out: str, world_size: int, strip_prefix: tuple[str, ...], overwrite: bool, storage_options: dict,
          quiet: bool) -> None:
    """Split a full model into a WORLD-rank checkpoint (weights only).

    SRC is one .safetensors file or an HF-style folder (model.safetensors.index.json plus
    shards), or a torch.save file (pytorch_model.bin, model.pt; its pickle read through a closed
    allowlist, never run) or a folder of them (pytorch_model.bin.index.json). Every tensor is
    flattened and cut into WORLD near-equal contiguous pieces; rank r gets piece r. Data is
    streamed: memory stays at one copy buffer (4 MiB; 32 MiB on S3) whatever the model size.
    """
    from zeroshard.toolkit.shard import shard as run

    manifest = run(src, out, world_size, overwrite=overwrite, storage_options=storage_options, quiet=quiet,
                   strip_prefix=list(strip_prefix))
    for note in manifest.extra.get("source_notes", []):
        click.echo(f"note: {note}")
    n = sum(t.numel for t in manifest.tensors.values())
    click.echo(f"wrote {out}: {len(manifest.tensors)} tensors ({n:,} elements) over {world_size} ranks")


@main.command()
@click.argument("ckpt")
@click.argument("out")
@click.option("--dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="Cast floating-point weights (default: as stored, bit-exact).")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Write HF's sharded layout with files up to SIZE (e.g. 5GB, 500MB, 2GiB) into folder OUT.")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Write only tensors whose name matches GLOB (repeatable; fnmatch, as load_state_dict).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Leave out tensors whose name matches GLOB (repeatable; wins over --include).")
@click.option("--strip-prefix", multiple=True, metavar="PREFIX",
              help="Remove a leading PREFIX (e.g. module. or _orig_mod.) from every output name (repeatable).")
@click.option("--config", "config", default=None, metavar="FILE",
              help="Copy JSON FILE into folder OUT as config.json (default: the model config the "
                   "checkpoint carries, if any).")
@click.option("--peft", is_flag=True,
              help="Write a PEFT adapter folder: adapter_model.safetensors (the adapter's tensors, named as PEFT's "
                   "save_pretrained names them) + adapter_config.json; PeftModel.from_pretrained loads it.")
@click.option("--adapter-config", default=None, metavar="FILE",
              help="With --peft: copy FILE (PEFT's adapter_config.json) into OUT (default: the PEFT config "
                   "recorded at save).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("-j", "--workers", type=click.IntRange(min=1), default=None,
              help="Workers sharing the work on this machine: threads for big files, else processes "
                   "(default: every core, up to 8, for a job "
                   "of 4,096+ files or 256+ MiB; else 1). Local outputs; see docs/SCALE.md.")
@click.option("--distributed/--single", "distributed", default=None,
              help="Share the work among the processes torchrun started (default: when launched by torchrun "
                   "with WORLD_SIZE > 1); inputs and OUT on a filesystem every process reaches. docs/SCALE.md.")
@click.option("--dry-run", is_flag=True, help="Print what would be read and written (files, bytes); write nothing.")
@_common
def consolidate(ckpt: str, out: str, dtype: str | None, max_shard_size: str | None, include: tuple[str, ...],
                exclude: tuple[str, ...], strip_prefix: tuple[str, ...], config: str | None, peft: bool,
                adapter_config: str | None, overwrite: bool, workers: int | None, distributed: bool | None,
                dry_run: bool, storage_options: dict, quiet: bool) -> None:
    """Write the full model's weights from checkpoint CKPT.

    \b
    OUT ending in .safetensors: one file.
    OUT a folder: HF's layout, model-00001-of-0000N.safetensors + model.safetensors.index.json
    (or a single model.safetensors when everything fits in one shard, as HF does), loadable with
    transformers' from_pretrained once a config.json sits beside it.
    --peft: OUT a folder of a PEFT adapter, as PeftModel.save_pretrained writes it.

    Each rank file is read once, front to back, hash-checked, and every fragment placed at its
    offset (S3 outputs are streamed front to back instead); tied weights recorded in the
    manifest are written under both names. A glob matching no tensor, or two names made one
    by --strip-prefix, is an error before anything is written.
    """
    from zeroshard.toolkit.consolidate import consolidate as run

    if out.rstrip("/").lower().endswith(NOT_SAFETENSORS):
        raise ZeroshardError(f"{out}: consolidate writes safetensors, not {out.rsplit('.', 1)[-1]}: name the file "
                             f"*.safetensors (one file) or give a folder (HF's layout)")
    choice = {"include": list(include), "exclude": list(exclude), "strip_prefix": list(strip_prefix)}
    if peft or adapter_config is not None:  # an adapter is small: one process writes it
        if distributed:
            raise ZeroshardError(f"{out}: --peft writes in one process; drop --distributed")
        distributed = False
        choice.update(peft=peft, adapter_config=adapter_config)
    torchrun = not dry_run and _use_torchrun(distributed)
    opened = None if torchrun else _open(ckpt, storage_options)
    if dry_run:
        from zeroshard.toolkit.consolidate import dry_run as plan_only

        click.echo(plan_only(opened, out, dtype=dtype, max_shard_size=max_shard_size, storage_options=storage_options,
                             **choice))
        return
    choice["config"] = config
    if torchrun:
        from zeroshard.toolkit.distributed import consolidate_distributed

        source = _source(ckpt, storage_options)
        with _process_group() as rank:
            files = consolidate_distributed(ckpt, out, max_shard_size=max_shard_size, dtype=dtype,
                                            overwrite=overwrite, storage_options=storage_options, workers=workers or 1,
                                            **choice)
        if rank:
            return
    else:
        source = opened.describe()
        files = run(opened, out, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                    storage_options=storage_options, quiet=quiet, workers=workers, **choice)
    click.echo(f"wrote {len(files)} file(s): {files[0]}" + (f" .. {files[-1]}" if len(files) > 1 else "")
               + (f" from {source}" if source else ""))


NOT_SAFETENSORS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".safetensor", ".st", ".npz", ".json")


def _open(ckpt: str, storage_options: dict) -> "OpenedCheckpoint":
    """The command's input checkpoint, opened once here and handed to the command (its checks,
    the command and its closing line then read one manifest: format.OpenedCheckpoint)."""
    from zeroshard.format import opened_checkpoint

    return opened_checkpoint(ckpt, storage_options)


def _source(ckpt: str, storage_options: dict) -> str | None:
    """'FOLDER (step N, world W)' in the torchrun mode, where each process opens the input itself
    and they agree on it (toolkit/distributed.py). None when it cannot be read: the command
    itself then reports why, on every process alike."""
    try:
        return _open(ckpt, storage_options).describe()
    except ZeroshardError:
        return None


def _use_torchrun(flag: bool | None) -> bool:
    """--distributed / --single, or by default: this process is a torchrun worker of a group of 2+.
    A program that torchrun started and that runs `zeroshard` itself passes its environment on, so
    the parent process must be torchrun's agent too (Linux; elsewhere pass --distributed)."""
    if flag is not None:
        return flag
    if int(os.environ.get("WORLD_SIZE", "1") or 1) < 2 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            parent = f.read().decode("utf-8", "replace").split("\0")[:3]  # python [-m] launcher, or torchrun
    except OSError:
        return False
    return any(os.path.basename(arg) == "torchrun" or arg == "torch.distributed.run"
               or arg.endswith("torch/distributed/run.py") for arg in parent)


_process_rank: int | None = None  # this process's rank in the torchrun mode, for its error lines


@contextlib.contextmanager
def _process_group() -> Iterator[int]:
    """A gloo group over torchrun's environment (TCP, no GPU) for the command; yields this rank."""
    import datetime

    import torch.distributed as dist

    global _process_rank
    dist.init_process_group("gloo", timeout=datetime.timedelta(hours=2))
    try:
        _process_rank = dist.get_rank()
        yield _process_rank
    finally:
        dist.destroy_process_group()


def _empty_ranks(ckpt: "str | OpenedCheckpoint", world_size: int, storage_options: dict) -> tuple[int, int] | None:
    """(ranks that would hold no element of any tensor, largest tensor's elements) at `world_size`."""
    from zeroshard.partition import owning_ranks

    try:
        manifest = _open(ckpt, storage_options).manifest
    except ZeroshardError:
        return None  # the command itself reports why (the torchrun mode: on every process alike)
    sizes = [t.numel for t in manifest.tensors.values() if t.layout == "flat" and t.numel]
    used = max((owning_ranks(n, world_size)[1] for n in sizes), default=world_size)
    return world_size - used, max(sizes, default=0)


@main.command()
@click.argument("ckpt")
@click.argument("out_arg", metavar="[OUT]", required=False)
@click.option("--to", "--world", "world_size", type=int, required=True,
              help="The new number of ranks (any M >= 1).")
@click.option("-o", "--out", default=None, help="OUT as an option (default: CKPT-world<M> beside CKPT).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@click.option("-j", "--workers", type=click.IntRange(min=1), default=None,
              help="Workers sharing the work on this machine: threads for big files, else processes "
                   "(default: every core, up to 8, for a job "
                   "of 4,096+ files or 256+ MiB; else 1). Local outputs; see docs/SCALE.md.")
@click.option("--allow-empty-ranks", is_flag=True,
              help="Write even when more than half the new ranks would hold no element of any tensor.")
@click.option("--distributed/--single", "distributed", default=None,
              help="Share the work among the processes torchrun started (default: when launched by torchrun "
                   "with WORLD_SIZE > 1); inputs and OUT on a filesystem every process reaches. docs/SCALE.md.")
@click.option("--dry-run", is_flag=True, help="Print what would be read and written (files, bytes); write nothing.")
@_common
def reshard(ckpt: str, out_arg: str | None, world_size: int, out: str | None, overwrite: bool, workers: int | None,
            allow_empty_ranks: bool, distributed: bool | None, dry_run: bool, storage_options: dict,
            quiet: bool) -> None:
    """Rewrite checkpoint CKPT for a different number of ranks, optimizer state included.

    Works for any M: larger, smaller, not a divisor. Each new rank's piece of every tensor is
    assembled from the old pieces that overlap it; fragments are hash-checked on the way in and
    hashed on the way out. Per-rank items (RNG states) are dropped when the world size changes.
    Local outputs are written rank-major: each input file is read once, front to back.
    """
    from zeroshard.toolkit.reshard import reshard as run

    if out_arg and out and out_arg != out:
        raise ZeroshardError(f"two outputs given ({out_arg} and -o {out}): give OUT once")
    out = out_arg or out
    torchrun = not dry_run and _use_torchrun(distributed)
    opened = None if torchrun else _open(ckpt, storage_options)
    empty = _empty_ranks(opened or ckpt, world_size, storage_options) if world_size > 1 else None
    if empty and empty[0] > world_size // 2 and not allow_empty_ranks:  # a typo'd --to, not a plan
        raise ZeroshardError(f"{ckpt}: at {world_size:,} ranks, {empty[0]:,} would hold no element of any tensor "
                             f"(the largest has {empty[1]:,}); pass --allow-empty-ranks to write them anyway")
    if dry_run:
        from zeroshard.toolkit.reshard import dry_run as plan_only

        click.echo(plan_only(opened, world_size, out, storage_options))
        return
    if torchrun:
        from zeroshard.toolkit.distributed import reshard_distributed

        if not out:
            raise ZeroshardError("--distributed needs OUT (every process must name the same folder)")
        with _process_group() as rank:
            url = reshard_distributed(ckpt, world_size, out, overwrite=overwrite, storage_options=storage_options,
                                      workers=workers or 1)
        if not rank:
            click.echo(f"wrote {url}: {world_size} ranks")
        return
    result = run(opened, world_size, out, overwrite=overwrite, storage_options=storage_options, quiet=quiet,
                 workers=workers)
    click.echo(f"wrote {result.location.url}: {len(result.manifest.tensors)} tensors over {world_size} ranks")
    if result.dropped:
        click.echo(f"dropped {len(result.dropped)} per-rank item(s) that do not carry to a new world size "
                   f"(e.g. {result.dropped[0]})")


@main.command()
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--tensors", "tensors", is_flag=False, flag_value="*", default=None, metavar="[GLOB]",
              help="List the tensors (name, role, dtype, shape, layout), those matching GLOB if given.")
@_common
def inspect(ckpt: str, as_json: bool, tensors: str | None, storage_options: dict, quiet: bool) -> None:
    """Summarize checkpoint CKPT from its manifest: world size, stage, step, parameters,
    bytes per rank, dtypes, optimizer. Reads no tensor data."""
    from zeroshard.toolkit.inspect import format_summary, inspect_checkpoint

    opened = _open(ckpt, storage_options)  # one manifest read for the summary and the tensor list
    info = inspect_checkpoint(opened)
    if tensors is not None:
        from zeroshard.toolkit.listing import format_tensors, list_tensors

        info["tensor_list"] = list_tensors(opened, tensors)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(format_summary(info))
    if tensors is not None:
        click.echo(format_tensors(info["tensor_list"]))


@main.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_common
def ls(root: str, as_json: bool, storage_options: dict, quiet: bool) -> None:
    """List the checkpoints under ROOT: tag, step, world size, stage, size, which one `latest`
    names (*), and saves that never committed or staging folders writers left. Reads manifests only."""
    from zeroshard.toolkit.listing import format_listing, list_checkpoints

    info = list_checkpoints(root, storage_options=storage_options)
    click.echo(json.dumps(info, indent=2) if as_json else format_listing(info))


@main.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance (of B's values).")
@click.option("--all", "every_role", is_flag=True, help="Compare optimizer state too (default: the weights).")
@click.option("--include", multiple=True, metavar="GLOB", help="Only tensors matching GLOB (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("-v", "--verbose", is_flag=True, help="List every tensor, not only those that differ.")
@_common
def diff_command(a: str, b: str, atol: float, rtol: float, every_role: bool, include: tuple[str, ...],
                 as_json: bool, verbose: bool, storage_options: dict, quiet: bool) -> None:
    """Compare checkpoints A and B tensor by tensor: max absolute and relative difference, at any
    world sizes, streaming. Exit 0 when every tensor is within |a-b| <= atol + rtol*|b| and both
    hold the same tensors; exit 3 when they differ."""
    from zeroshard.toolkit.diff import diff, format_report

    report = diff(a, b, atol=atol, rtol=rtol, roles=None if every_role else ("param", "buffer"),
                  include=list(include) or None, storage_options=storage_options)
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else format_report(report, verbose))
    if not report.equal:
        sys.exit(EXIT_VERIFY_FAILED)


@main.command()
@click.argument("ckpt")
@click.option("-j", "--workers", type=click.IntRange(min=1), default=None,
              help="Workers sharing the files: threads for big files, else processes (default: every "
                   "core, up to 8, for 256+ MiB).")
@click.option("--key-file", default=None, metavar="FILE",
              help="Also check the signature made by `zeroshard sign` with this key.")
@click.option("--deep", is_flag=True,
              help="Also check every fragment against its file's hash table (the writer's arithmetic; "
                   "a changed byte already fails the whole-file hash).")
@_common
def verify(ckpt: str, workers: int | None, key_file: str | None, deep: bool, storage_options: dict,
           quiet: bool) -> None:
    """Check checkpoint CKPT completely; exit 0 only if everything holds.

    Every rank file present with its recorded size; headers agree with the manifest; every byte
    of every file matches the manifest's whole-file hash (--deep: every fragment hash too);
    fragments cover every element of every tensor exactly once; no stray rank files. Lists
    every problem found (exit 3).
    """
    from zeroshard.format.signature import read_key
    from zeroshard.toolkit.verify import verify as run

    key = read_key(key_file) if key_file else None
    report = run(ckpt, storage_options=storage_options, quiet=quiet, key=key, workers=workers, deep=deep)
    if report.ok:
        click.echo(f"OK {report.location}: {report.files_checked} files, {report.tensors} tensors, "
                   f"{report.bytes_checked:,} bytes verified" + (", signature holds" if report.signed else ""))
        return
    for problem in report.problems:
        click.echo(f"FAIL {problem}", err=True)
    click.echo(f"zeroshard: verify found {len(report.problems)} problem(s) in {report.location}", err=True)
    sys.exit(EXIT_VERIFY_FAILED)


@main.command()
@click.argument("ckpt")
@click.option("--key-file", required=True, metavar="FILE", help="File holding the secret key (at least 16 bytes).")
@_common
def sign(ckpt: str, key_file: str, storage_options: dict, quiet: bool) -> None:
    """Verify checkpoint CKPT completely, then sign it: zeroshard.json.sig beside the manifest.

    An HMAC-SHA256 under your key over the manifest and the SHA-256 of every file: `zeroshard
    verify CKPT --key-file FILE` then shows that nobody without the key changed a byte. Symmetric:
    whoever can verify can also sign. See docs/SAFETY.md for what it does not promise.
    """
    from zeroshard.format.signature import read_key
    from zeroshard.toolkit.sign import sign as run

    click.echo(f"signed {run(ckpt, read_key(key_file), storage_options=storage_options, quiet=quiet)}")


@main.command()
@click.argument("path")
@click.option("--older-than", default="1h", show_default=True, metavar="AGE",
              help="Leftovers of unknown owner (another host, S3 uploads) count as stale from this age (30m, 2h, 1d).")
@click.option("--yes", "yes", is_flag=True, help="Remove them (default: only list; same as --dry-run).")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed (the default).")
@_common
def clean(path: str, older_than: str, yes: bool, dry_run: bool, storage_options: dict, quiet: bool) -> None:
    """List, then (with --yes) remove what interrupted writers left under PATH.

    Hidden temp files and staging folders (.zeroshard-tmp-*), claims of dead writers
    (.zeroshard-claim), the rank files of saves torn by a lost node (beside such a claim, no
    manifest) and, on S3, pending multipart uploads. A leftover of a live process on this host
    is never stale; one of another host or an S3 upload is stale once older than AGE (a claim
    also once its writer's heartbeat has been silent for 10 minutes).
    Committed checkpoints and any other file are never touched. A folder that cannot be read is
    named (one error line each) and skipped; the rest is cleaned, and the exit status is then 1.
    """
    from zeroshard.storage.location import Location
    from zeroshard.toolkit.clean import clean as run
    from zeroshard.toolkit.clean import parse_age

    root = Location(path, storage_options)
    if root.local and not root.exists():  # (an S3 prefix may hold only pending uploads: no objects)
        raise ZeroshardError(f"{path}: no such folder (nothing to clean)")

    report = run(path, older_than_s=parse_age(older_than), dry_run=dry_run or not yes, storage_options=storage_options)
    verb = "removed" if yes and not dry_run else "stale"
    for item in report.stale:
        click.echo(f"{verb} {item.kind}: {item.url} ({item.size:,} bytes)")
    for item, why in report.kept:
        click.echo(f"kept {item.kind}: {item.url} ({why})")
    for error in report.errors + report.unreadable:
        click.echo(f"zeroshard: error: {error}", err=True)
    if not report.stale and not report.kept:
        click.echo(f"nothing to clean under {path}" + (" in the folders it could read" if report.unreadable else ""))
    elif verb == "stale" and report.stale:
        click.echo(f"{len(report.stale)} stale leftover(s); run again with --yes to remove them")
    if report.unreadable:
        click.echo(f"{len(report.unreadable)} folder(s) could not be read, named above: any leftovers in them are "
                   "still there", err=True)
    if report.errors or report.unreadable:
        sys.exit(EXIT_ERROR)

# ---- interop: import from other tools (zeroshard/interop/sources.py), export to DCP -----------------

class _ImportGroup(click.Group):
    """`zeroshard import NAME`: one subcommand per import source, made from its entry in
    interop/sources.py when asked for, so a command imports only the source it names."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        from zeroshard.interop.sources import SOURCES

        return sorted(SOURCES)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        from zeroshard.interop.sources import SOURCES, source

        return _import_command(source(name)) if name in SOURCES else None

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self._name_sources()
        super().format_help_text(ctx, formatter)

    def get_short_help_str(self, limit: int = 45) -> str:
        self._name_sources()
        return super().get_short_help_str(limit)

    def _name_sources(self) -> None:
        """The help names every source's tool (their modules imported only for help)."""
        if self.help is None:
            from zeroshard.interop.sources import all_sources

            labels = [s.label for s in all_sources()]
            tools = f"{', '.join(labels[:-1])} or {labels[-1]}" if len(labels) > 1 else labels[0]
            self.help = f"Convert a {tools} checkpoint into a zeroshard checkpoint."


@main.group("import", cls=_ImportGroup)
def import_group() -> None:
    pass


def _import_command(source: Any) -> click.Command:
    """`zeroshard import NAME SRC OUT`: SRC read by the source, written as a zeroshard checkpoint."""
    lines = [o.flags[-1].lstrip("-").replace("-", "_") for o in source.options if o.kind == "lines"]

    def run(src: str, out: str, world_size: int | None, overwrite: bool, storage_options: dict, quiet: bool,
            **options: Any) -> None:
        from zeroshard.interop.write import check_world_size, release_large_blocks, write_imported

        check_world_size(world_size)  # before anything is read or touched
        release_large_blocks()  # this process only imports: freed windows go back to the system
        for key in lines:  # a file of one entry a line, as a list
            if options[key] is not None:
                options[key] = [n.strip() for n in options[key].read().splitlines() if n.strip()]
        # SRC may be s3:// (the same storage options as OUT)
        imported = source.read(src, storage_options=storage_options, **options)
        _report_import(write_imported(imported, out, world_size, tag=source.name, overwrite=overwrite,
                                      storage_options=storage_options, source=src), out)

    kinds: dict[str, dict[str, Any]] = {"value": {"default": None}, "int": {"type": int, "default": None},
                                        "flag": {"is_flag": True},
                                        "lines": {"type": click.File("r", encoding="utf-8"), "default": None}}
    decorators = [click.argument("src"), click.argument("out"),
                  click.option("--world", "--to", "world_size", type=int, default=None, help=source.world_help),
                  *(click.option(*o.flags, metavar=o.metavar, help=o.help, **kinds[o.kind]) for o in source.options),
                  click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")]
    command = _common(run)
    for decorate in reversed(decorators):
        command = decorate(command)
    return click.command(source.name, help=source.help)(command)


def _report_import(manifest: Any, out: str) -> None:
    params = [t for t in manifest.tensors.values() if t.role == "param"]
    with_state = {t.param for t in manifest.tensors.values() if t.role == "optimizer"}
    frozen = sum(1 for t in params if t.name not in with_state) if with_state else 0
    click.echo(f"wrote {out}: {len(params)} parameters ({sum(t.numel for t in params):,} elements"
               f"{f'; {frozen} without optimizer state (frozen, or never stepped)' if frozen else ''}), "
               f"step {manifest.step}, over {manifest.world_size} ranks")
    for note in manifest.extra.get("import_notes") or []:
        click.echo(f"zeroshard: note: {note}", err=True)


@main.group("export")
def export_group() -> None:
    """Convert a zeroshard checkpoint into another format."""


@export_group.command("dcp")
@click.argument("ckpt")
@click.argument("out")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@_common
def export_dcp(ckpt: str, out: str, overwrite: bool, storage_options: dict, quiet: bool) -> None:
    """Write CKPT as a DCP checkpoint {"model": ..., "optim": ...} that FSDP2's dcp.load reads,
    with each saved Stateful state (an LR scheduler's) under its own key and the client state
    under "client_state". Per-rank states (RNG streams) are not exported; the output says so.

    OUT may be s3://: DCP's writer writes a local temporary folder (one copy of the export's
    size), uploaded with `.metadata` last."""
    from zeroshard.interop.dcp_export import export_dcp as run
    from zeroshard.interop.dcp_export import export_extras

    n = run(ckpt, out, overwrite=overwrite, storage_options=storage_options)
    keys, ranks = export_extras(ckpt, storage_options)
    click.echo(f"wrote {out}: {n} tensors (DCP)" + (f"; also {', '.join(map(repr, keys))}" if keys else ""))
    if ranks:
        click.echo(f"zeroshard: note: the per-rank state (RNG streams) of {ranks} rank(s) is not exported: a "
                   "DCP full-state export has no per-rank part", err=True)


def _register_estimate() -> None:
    from zeroshard.estimate import estimate_command, parse_count  # pure arithmetic: no torch, no engine

    # --plot is added here, beside the table command: matplotlib is imported only when asked for
    estimate_command.params.append(click.Option(
        ["--plot"], metavar="FILE", default=None,
        help="Also draw memory per device against device count, by stage, into FILE (.png, .svg, .pdf; "
             "needs the plot extra)."))
    table = estimate_command.callback

    def with_plot(plot: str | None = None, **kwargs: Any) -> None:
        import importlib.util

        if plot and importlib.util.find_spec("matplotlib") is None:  # before the table: one clear failure
            from zeroshard.estimate_plot import PLOT_EXTRA_HINT

            raise click.ClickException(PLOT_EXTRA_HINT)
        table(**kwargs)
        if plot:
            from zeroshard.estimate_plot import plot_memory

            try:
                plot_memory(parse_count(kwargs["params"]), kwargs["gpus"], plot, kwargs["dtype"])
            except ZeroshardError as exc:
                raise click.ClickException(str(exc)) from None
            click.echo(f"wrote {plot}")

    estimate_command.callback = with_plot
    main.add_command(estimate_command, "estimate")


_register_estimate()


if __name__ == "__main__":
    main()
