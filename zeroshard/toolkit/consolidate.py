"""`zeroshard consolidate`: the full model's weights out of a sharded checkpoint.

Output is one `.safetensors` file, or HF's sharded layout (`model-00001-of-0000N.safetensors`
plus `model.safetensors.index.json`). The output headers are computed from the manifest up front.
Local outputs are filled rank-major (zeroshard.toolkit.transfer: each rank file read once, each
fragment placed at its offset; optionally by several processes); S3 outputs are streamed front to
back. Without a dtype cast the output bytes are the stored bytes: bit-exact.

include/exclude (fnmatch globs, exclude wins) and strip_prefix follow zeroshard.load_state_dict's
rules, so a name chosen there is chosen here. A folder output gets a config.json: the file given,
else the model config the checkpoint carries (manifest extra or client state "model_config").
`peft=True` writes a PEFT adapter folder instead (zeroshard.toolkit.adapters).
"""

from __future__ import annotations

import json
import os
import re

from zeroshard.errors import ZeroshardError
from zeroshard.format import OpenedCheckpoint, opened_checkpoint
from zeroshard.format.full_model import HF_INDEX_NAME, split_file_url
from zeroshard.format.manifest import Manifest
from zeroshard.format.output import PreparedOutput, output_transaction, prepare_file_output, prepare_output
from zeroshard.storage.location import Location
from zeroshard.toolkit.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_output
from zeroshard.toolkit.progress import byte_bar
from zeroshard.toolkit.selection import OutputTensor, model_tensors, output_files, parse_size, plan_shards  # noqa: F401
from zeroshard.toolkit.transfer import commit, create_outputs, discard, write_plan
from zeroshard.toolkit.workers import auto_workers

CONFIG_NAME = "config.json"


@output_transaction
def consolidate(ckpt: str | OpenedCheckpoint, out: str, *, dtype: str | None = None, max_shard_size: str | None = None,
                overwrite: bool = False, storage_options: dict | None = None, quiet: bool = True,
                workers: int | None = 1, include: list[str] | None = None, exclude: list[str] | None = None,
                strip_prefix: list[str] | None = None, config: str | None = None, peft: bool = False,
                adapter_config: str | None = None) -> list[str]:
    """Write the model's weights at `out`; returns the URLs of the files written,
    config.json last when one is written (`workers=None`: auto_workers).
    include/exclude: globs on tensor names; strip_prefix: leading prefixes removed from output names;
    config: a JSON file written as the folder's config.json (default: the checkpoint's model config).
    peft: write folder `out` as PEFT's save_pretrained does, adapter_model.safetensors (the adapter's
    tensors under PEFT's names) and adapter_config.json (`adapter_config`, a file, else the one
    recorded at save). `ckpt`: a path (any os.PathLike), or a checkpoint the caller opened
    (format.opened_checkpoint)."""
    out = os.fspath(out)
    if workers is not None and workers < 1:
        raise ZeroshardError(f"--workers must be at least 1, got {workers}")
    opened = opened_checkpoint(ckpt, storage_options)
    source, manifest = opened.location, opened.manifest
    choice = {"include": include, "exclude": exclude, "strip_prefix": strip_prefix}
    config_name = ADAPTER_CONFIG if peft else CONFIG_NAME
    if peft:
        check_peft(out, max_shard_size, config)
        folder, names, shards, total, config_bytes = plan_adapter(source, manifest, out, dtype, adapter_config,
                                                                  **choice)
        single_file = False
    else:
        if adapter_config is not None:
            raise ZeroshardError(f"{adapter_config}: --adapter-config goes with --peft (an adapter folder)")
        folder, names, shards, total, single_file = plan(source, manifest, out, dtype=dtype,
                                                         max_shard_size=max_shard_size, **choice)
        config_bytes = model_config(manifest, config, single_file, out)  # checked before anything is written
    output = prepare(folder, names, single_file, overwrite, [opened.given, source])
    if workers is None:
        workers = auto_workers(manifest.world_size, total)
    with byte_bar(total, "consolidate", quiet) as bar:
        _write(source, manifest, output.stage if output else folder, names, shards, bar.update, workers)
    if output is not None:
        finish_folder(output, names, shards, total, config_bytes, config_name)
    return [folder.url_of(name) for name in names] + ([folder.url_of(config_name)] if config_bytes else [])


def plan(source: Location, manifest: Manifest, out: str, *, dtype: str | None, max_shard_size: str | None,
         include: list[str] | None = None, exclude: list[str] | None = None, strip_prefix: list[str] | None = None,
         ) -> tuple[Location, list[str], list[list[OutputTensor]], int, bool]:
    """What consolidate writes: (folder, file names, tensors per file, total bytes, single file?)."""
    tensors = model_tensors(source.url, manifest, dtype, include, exclude, strip_prefix)
    names, shards, single_file = output_files(out, tensors, max_shard_size)
    folder = Location(split_file_url(out)[0] if single_file else out, source.storage_options)
    return folder, names, shards, sum(t.nbytes for t in tensors), single_file


def plan_adapter(source: Location, manifest: Manifest, out: str, dtype: str | None, adapter_config: str | None, *,
                 include: list[str] | None = None, exclude: list[str] | None = None,
                 strip_prefix: list[str] | None = None) -> tuple[Location, list[str], list[list[OutputTensor]], int,
                                                                 bytes]:
    """What consolidate --peft writes: (folder, [adapter_model.safetensors], its tensors, total
    bytes, adapter_config.json's bytes). Refused before anything is written when the checkpoint
    holds no adapter tensors, or no config is recorded and none given."""
    tensors = model_tensors(source.url, manifest, dtype, include, exclude, strip_prefix)
    given = (adapter_config, *user_json(adapter_config, "--adapter-config")) if adapter_config is not None else None
    tensors, config_bytes = adapter_output(source.url, manifest, tensors, given)
    total = sum(t.nbytes for t in tensors)
    return Location(out, source.storage_options), [ADAPTER_WEIGHTS], [tensors], total, config_bytes


def check_peft(out: str, max_shard_size: str | None, config: str | None) -> None:
    """--peft writes one folder of PEFT's own layout: options of the model's layout are refused."""
    if out.rstrip("/").endswith(".safetensors"):
        raise ZeroshardError(f"{out}: --peft writes an adapter folder (adapter_model.safetensors + "
                             f"adapter_config.json); give a folder as OUT")
    if max_shard_size is not None:
        raise ZeroshardError(f"{out}: --peft writes one adapter_model.safetensors; drop --max-shard-size")
    if config is not None:
        raise ZeroshardError(f"{config}: --peft writes adapter_config.json: give it with --adapter-config, "
                             f"not --config")


def dry_run(ckpt: str | OpenedCheckpoint, out: str, *, dtype: str | None = None, max_shard_size: str | None = None,
            storage_options: dict | None = None, include: list[str] | None = None, exclude: list[str] | None = None,
            strip_prefix: list[str] | None = None, peft: bool = False, adapter_config: str | None = None) -> str:
    """What `consolidate` would read and write, from the manifest alone: nothing is written."""
    from zeroshard.toolkit.plan_summary import describe_files  # numpy: only when asked

    opened = opened_checkpoint(ckpt, storage_options)
    source, manifest = opened.location, opened.manifest
    choice = {"include": include, "exclude": exclude, "strip_prefix": strip_prefix}
    if peft:
        check_peft(os.fspath(out), max_shard_size, None)
        folder, names, shards, total, _ = plan_adapter(source, manifest, os.fspath(out), dtype, adapter_config,
                                                       **choice)
    else:
        folder, names, shards, total, _ = plan(source, manifest, os.fspath(out), dtype=dtype,
                                               max_shard_size=max_shard_size, **choice)
    return (f"dry run: {source.url} -> {folder.url}: {len(names)} file(s), {total:,} bytes of weights; nothing "
            f"written\n" + describe_files(manifest, names, shards))


def model_config(manifest: Manifest, config: str | None, single_file: bool, out: str) -> bytes | None:
    """config.json's bytes: the file `config`, else the checkpoint's model config; None for none.
    A single .safetensors file has no place for it: --config is refused there."""
    if config is not None:
        if single_file:
            raise ZeroshardError(f"{out}: --config writes config.json into an HF folder; give a folder as OUT")
        return user_json(config, "--config")[0]  # copied as given, byte for byte
    carried = carried_config(manifest)
    if carried is None or single_file:
        return None
    return json.dumps(carried, indent=2, sort_keys=True).encode() + b"\n"


def user_json(path: str, flag: str) -> tuple[bytes, dict]:
    """The bytes and the JSON object of a user's file given with `flag` (--config, --adapter-config)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        doc = json.loads(data)
    except OSError as exc:
        raise ZeroshardError(f"{path}: cannot read the {flag} file ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ZeroshardError(f"{path}: {flag} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ZeroshardError(f"{path}: {flag} must hold a JSON object, not {type(doc).__name__}")
    return data, doc


def carried_config(manifest: Manifest) -> dict | None:
    """The model config a checkpoint carries: client state ["model_config"] when the script gave
    one (`client_state={"model_config": ...}`), else manifest extra["model_config"] (recorded by
    the engine's save from `model.config`)."""
    client = manifest.client_state if isinstance(manifest.client_state, dict) else {}
    for found in (client.get("model_config"), manifest.extra.get("model_config")):
        if isinstance(found, str):
            try:
                found = json.loads(found)
            except ValueError:
                continue
        if isinstance(found, dict):
            return found
    return None


def prepare(folder: Location, names: list[str], single_file: bool, overwrite: bool,
            inputs: list[Location]) -> PreparedOutput | None:
    """Identity, claim and stage for the output (docs/SAFETY.md). A single file is replaced
    atomically (the old one stays until the new one is complete): no stage, None."""
    if single_file:
        prepare_file_output(folder, names[0], overwrite, inputs)
        return None
    return prepare_output(folder, overwrite, inputs)


def _write(source: Location, manifest: Manifest, stage: Location, names: list[str],
           shards: list[list[OutputTensor]], progress, workers: int) -> None:
    """The files, under `stage` (transfer.write_plan). Local ones are created first and filled by
    tasks of consecutive pieces, so workers share even a single big file, a part of the plan at a
    time (plan_file_parts: memory bounded at any world size); then moved to their names."""
    from zeroshard.toolkit.plan import plan_file_parts, plan_files  # numpy: when a copy starts

    if not stage.local:  # streamed, object by object, from the whole plan (not yet bounded: docs/SCALE.md)
        write_plan(source, manifest, stage, plan_files(manifest, names, shards), workers, progress)
        return
    parts = plan_file_parts(manifest, names, shards)
    part = next(parts)
    created = create_outputs(stage, part)
    try:
        temp_paths = {i: f.temp_path for i, f in enumerate(created)}
        while part is not None:
            write_plan(source, manifest, stage, part, workers, progress, temp_paths)
            part = next(parts, None)
        commit(stage, created, durable=True)
    except BaseException:
        discard(created)
        raise


def finish_folder(output: PreparedOutput, names: list[str], shards: list[list[OutputTensor]], total: int,
                  config: bytes | None = None, config_name: str = CONFIG_NAME) -> None:
    """Commit HF's layout: the index last (it vouches for the files); files of an older export removed.
    `config`: written as `config_name` (config.json, or a PEFT adapter's) beside the weights, moved in with them."""
    index = None
    if len(names) > 1:
        weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
        index_json = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        index = (HF_INDEX_NAME, index_json.encode())
    if config is not None:
        output.stage.write_bytes(config_name, config)
        names = [*names, config_name]
    stale = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
    output.commit(names, index, uncommit=[HF_INDEX_NAME], stale=lambda n: bool(stale.match(n)))
