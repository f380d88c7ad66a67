"""Reading a DeepSpeed checkpoint folder into an Imported: which layout `src` is, and the
per-rank ZeRO 1/2/3 files (universal folders: deepspeed_universal.py; what all share:
deepspeed_common.py).

Accepted `src` (docs/DEEPSPEED.md has the table): a tag folder; a save_dir with `latest` (or
only `latest_universal`); a ds_to_universal output folder; Hugging Face Trainer's
`checkpoint-N` (a save_dir, with trainer_state.json beside the tag folder); a Trainer run folder
holding exactly one `checkpoint-N` (several: refused, listing them; which one is the user's
call, not ours: the newest may be half-written or not the best).

Layout (DeepSpeed's engine save; deepspeed/utils/zero_to_fp32.py is the reference reader):
  ROOT/latest                       names the tag folder
  TAG/mp_rank_00_model_states.pt    stages 1-2: module state dict (buffers), param_shapes (one
                                    ordered {name: shape} per param group), shared_params (ties),
                                    global_steps, skipped_steps, lr_scheduler, ds_config; the
                                    client state is merged into the same dict
  TAG/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: the same, one per rank
  TAG/zero_pp_rank_R_mp_rank_00_optim_states.pt   optimizer_state_dict of rank R:
    stages 1-2: single_partition_of_fp32_groups[g] (rank R's slice of group g's flat fp32
                buffer, tail padding dropped), base_optimizer_state {state: {g: {exp_avg, ...}},
                param_groups}; the flat buffer is the group's params in param_shapes order
    stage 3:    fp32_flat_groups[g]: per parameter, its ceil(n/world) slice of rank R, padded;
                optimizer_state_dict {state: {g: ...}, param_groups}
  bf16_zero_pp_rank_R_...: bf16 runs. Stage 2: the same layout. Stage 1 with fp32 gradient
    accumulation (BF16_Optimizer): no zero_stage, each rank's fp32 slice padded equally
    (group_paddings on the last), base_optimizer_state as stage 1's.
Only data-parallel checkpoints (mp_rank_00 only, no pipeline) are read.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
from typing import Any

from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.format.manifest import is_safe_file_name
from zeroshard.interop import files, torch_zip
from zeroshard.interop.beside import carry_beside, is_beside
from zeroshard.interop.deepspeed_common import (
    fill_from_model,
    gather_frozen_stage3,
    int_field,
    load_model_states,
    optimizer_scalar,
)
from zeroshard.interop.hf_folders import is_trainer_checkpoint, trainer_checkpoints
from zeroshard.interop.imported import Flat, Imported, is_tensor
from zeroshard.interop.source import Source
from zeroshard.interop.torch_pickle import read_small_file
from zeroshard.storage.location import Location

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Files of layouts whose weights live outside the files read here: an import would exit having
# lost them (MoE experts: layer_L_expert_E_... / expert_E_... and expp_rank_... optimizer files;
# pipeline stages: layer_NN-model_MM-model_states.pt), so they are refused by name.
_UNREAD = {"mixture-of-experts": re.compile(r"^(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$"
                                            r"|^expp_rank_\d+_mp_rank_\d+_optim_states\.pt$"),
           "pipeline-parallel": re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")}
MAX_LATEST_BYTES = 4096  # `latest` holds one tag name


def _follow(src: str, pointer: str) -> str:
    """The folder inside `src` that the one-line file `src/pointer` names."""
    path = files.join(src, pointer)
    raw = read_small_file(path, MAX_LATEST_BYTES)
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(path, "is not UTF-8 text (it should name the tag folder)") from None
    folder = files.join(src, tag)
    if "/" in tag or "\0" in tag or tag in ("", ".", "..") or not files.isdir(folder) or files.islink(folder):
        raise CheckpointError(path, f"names {tag!r}, which is not a checkpoint folder inside {src}")
    return folder


def resolve(src: str, runs_allowed: bool = True) -> tuple[str, str]:
    """("zero", tag folder) or ("universal", ds_to_universal folder) for the checkpoint at `src`;
    a Trainer run folder is looked into once (not inside a checkpoint-N, not through links)."""
    src = os.fspath(src)  # any os.PathLike
    from zeroshard.interop.deepspeed_universal import is_universal_folder

    if not files.isdir(src):
        raise CheckpointError(src, "no such DeepSpeed checkpoint folder")
    names = files.listdir(src)  # a listing, not glob: `lr[3e-4]` is a plain name
    if any(_OPTIM.match(name) for name in names):
        return "zero", src
    if is_universal_folder(src):
        return "universal", src
    # both pointers: `latest` is the exact per-rank save (and the newer one if training went on
    # after a conversion); the universal folder can still be named directly
    if files.exists(files.join(src, "latest")):
        return "zero", _follow(src, "latest")
    if files.exists(files.join(src, "latest_universal")):
        folder = _follow(src, "latest_universal")
        if not is_universal_folder(folder):
            raise CheckpointError(files.join(src, "latest_universal"), f"names {posixpath.basename(folder)!r}, "
                                  "which has no zero/optimizer_state.pt (not a universal checkpoint)")
        return "universal", folder
    runs = [n for n in trainer_checkpoints(names) if runs_allowed
            and files.isdir(files.join(src, n)) and not files.islink(files.join(src, n))]
    if len(runs) == 1:
        return resolve(files.join(src, runs[0]), runs_allowed=False)
    if runs:
        shown = ", ".join(runs[:6]) + (f", ... ({len(runs)} in all)" if len(runs) > 6 else "")
        raise CheckpointError(src, f"holds several Trainer checkpoints ({shown}): name the one to import")
    weights = [n for n in ("model.safetensors.index.json", "model.safetensors") if n in names]
    shard_src = src if weights[:1] == ["model.safetensors.index.json"] else files.join(src, "model.safetensors")
    hint = (f"; it holds {weights[0]}, model weights (a Trainer checkpoint without DeepSpeed, or an HF model "
            f"folder): `zeroshard shard {shard_src} OUT --world N` starts a checkpoint from them"
            if weights else "")
    if is_trainer_checkpoint(names):  # the Trainer's DDP save: torch's optimizer.state_dict() beside
        hint = (f"; it is a Hugging Face Trainer checkpoint without DeepSpeed (model weights and optimizer.pt): "
                f"`zeroshard import dcp {src} OUT` imports it with its optimizer state and schedule")
    raise CheckpointError(src, "not a DeepSpeed checkpoint: no *_optim_states.pt files, no 'latest' or "
                               f"'latest_universal', no checkpoint-N folder{hint}")


def _optim_files(folder: str) -> list[str]:
    found = {}
    prefixes = set()
    for name in files.listdir(folder):
        kind = next((k for k, pattern in _UNREAD.items() if pattern.match(name)), None)
        if kind is not None:
            raise CheckpointError(files.join(folder, name), f"a {kind} DeepSpeed checkpoint: its weights in files "
                                                            "like this one are not read, and an import without "
                                                            "them would lose them; not supported")
        m = _OPTIM.match(name)
        if m:
            if int(m.group(2)) != 0:
                raise CheckpointError(files.join(folder, name),
                                      "model-parallel checkpoints (mp_rank > 0) are not supported")
            found[int(m.group(1))] = files.join(folder, name)
            prefixes.add(name.startswith("bf16_"))
    if len(prefixes) > 1:  # two saves in one folder: which is this checkpoint's is not ours to guess
        raise CheckpointError(folder, "holds both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files")
    if not found or sorted(found) != list(range(len(found))):
        raise CheckpointError(folder, f"expected zero_pp_rank_0..N-1 optimizer files, found ranks {sorted(found)}")
    return [found[r] for r in range(len(found))]


def read_deepspeed(src: str, storage_options: dict | None = None) -> Imported:
    """Read the DeepSpeed checkpoint at `src` (any layout `resolve` accepts), a local path or a
    URL (s3://; `storage_options` for its filesystem)."""
    src = os.fspath(src)  # any os.PathLike
    with files.storage_options(storage_options):
        return _read_deepspeed(src)


def _is_deepspeed_file(name: str) -> bool:
    return name.endswith(("_model_states.pt", "_optim_states.pt"))


def recognise(location: Location, names: list[str]) -> str | None:
    """A tag folder or universal folder by its file names; a save_dir (global_step* folders, or
    the one `latest` names: Accelerate's is `pytorch_model`) by the names in its first tags."""
    if any(_is_deepspeed_file(n) for n in names) or "zero" in names and any(n.startswith("mp_rank_") for n in names):
        return "a DeepSpeed checkpoint"
    tags = [n for n in names if n.startswith("global_step")][:3]
    if "latest" in names:
        try:
            latest = location.read_bytes("latest", 0, MAX_LATEST_BYTES).decode("utf-8", "replace").strip()
            tags += [latest] if is_safe_file_name(latest) and latest in names else []
        except (OSError, ZeroshardError):
            pass  # the global_step* names may still tell
    for tag in tags:
        try:
            if any(_is_deepspeed_file(m) for m in location.child(tag).list()):
                return "a DeepSpeed checkpoint folder"
        except (OSError, ZeroshardError):
            continue  # not a readable folder: no hint from it
    return None


SOURCE = Source(
    name="deepspeed", label="DeepSpeed", recognise=recognise, read=read_deepspeed,
    help="""A DeepSpeed ZeRO 1/2/3 checkpoint (SRC: the save_dir with `latest`, a tag folder, a
    Hugging Face Trainer checkpoint-N or run folder, or a Universal Checkpoint folder). fp32,
    bf16 (bf16_zero_pp_rank_*) and CPU-offload (DeepSpeedCPUAdam) runs are read alike.

    fp32 master weights, Adam moments and step, param groups, global step, client state and
    tied weights come across; `engine.load_checkpoint(OUT)` resumes where DeepSpeed stopped.
    The .pt files are read with torch's weights_only unpickler and a closed allowlist. SRC and
    OUT may be local or s3:// (--storage-option applies to both).
    """)


def _read_deepspeed(src: str) -> Imported:
    from zeroshard.interop.deepspeed_universal import read_universal

    kind, folder = resolve(src)
    try:
        imp = _read(folder) if kind == "zero" else read_universal(folder)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError, RuntimeError) as exc:  # a layout unknown
        raise CheckpointError(folder, f"unexpected DeepSpeed checkpoint layout ({type(exc).__name__}: {exc}); "
                                      "ZeRO 1/2/3 data-parallel checkpoints are supported") from None
    parent = files.parent(folder)
    beside = [n for n in files.listdir(parent) if is_beside(n)]
    carry_beside(imp, parent, beside, f"beside {posixpath.basename(folder)}/")
    return imp


def _read(folder: str) -> Imported:
    optim_paths = _optim_files(folder)
    world = len(optim_paths)
    optims = [torch_zip.load_lazy(p, folder) for p in optim_paths]  # big tensors unread until written
    osds = []
    for path, sd in zip(optim_paths, optims):
        if not isinstance(sd, dict) or not isinstance(sd.get("optimizer_state_dict"), dict):
            raise CheckpointError(path, "not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict)")
        osds.append(sd["optimizer_state_dict"])
    stage = int_field(optim_paths[0], osds[0].get("zero_stage"), "zero_stage", -1)
    if stage == -1 and posixpath.basename(optim_paths[0]).startswith("bf16_") \
            and "single_partition_of_fp32_groups" in osds[0]:
        stage = 1  # DeepSpeed's BF16_Optimizer (bf16 at ZeRO 1) records no stage; its layout is stage 1's
    if stage not in (1, 2, 3):
        raise CheckpointError(optim_paths[0], f"unsupported ZeRO stage {stage} (1, 2 or 3 expected)")
    for path, osd in zip(optim_paths, osds):  # every file, not just rank 0's: a mixed set is refused
        if stage < 3 and isinstance(osd.get("base_optimizer_state"), list):
            raise CheckpointError(path, "saved with zero_optimization.elastic_checkpoint (optimizer state per "
                                        "param group, not torch's optimizer state_dict): not supported")
        parts = osd.get("partition_count")
        parts = max(parts) if isinstance(parts, list) and parts else parts
        parts = int_field(path, parts, "partition_count", -1)
        if parts != world:
            raise CheckpointError(folder, f"the optimizer files say {parts} partitions but {world} files are present")

    model_path = files.join(folder, "mp_rank_00_model_states.pt" if stage < 3
                              else "zero_pp_rank_0_mp_rank_00_model_states.pt")
    model, groups_shapes, ds_config = load_model_states(model_path, folder)
    imp = Imported(source=f"deepspeed:{files.absolute(folder)}", params={}, zero_stage=stage, world_size=world)
    if stage < 3:
        _flat_stage12(imp, optim_paths, osds, groups_shapes)
    else:
        _flat_stage3(imp, optim_paths, osds, groups_shapes)
    base = osds[0].get("base_optimizer_state" if stage < 3 else "optimizer_state_dict") or {}
    frozen = gather_frozen_stage3(folder, world, model_path, model) if stage == 3 else None
    fill_from_model(imp, folder, model_path, model, groups_shapes, ds_config, base.get("param_groups"),
                    osds[0].get("loss_scaler"), frozen)
    return imp


def _flat_stage12(imp: Imported, paths: list[str], osds: list[dict], groups_shapes: list[dict]) -> None:
    """Stages 1-2: concatenate the ranks' partitions of each group, cut by param_shapes."""
    import torch

    for g, shapes in enumerate(groups_shapes):
        for path, osd in zip(paths, osds):
            if "single_partition_of_fp32_groups" not in osd:
                raise CheckpointError(path, "no single_partition_of_fp32_groups (a non-ZeRO optimizer "
                                            "file?): not supported")
            if any((osd.get("param_alignment_paddings") or [[]] * (g + 1))[g]):
                raise CheckpointError(path, "per-parameter alignment padding is not supported")
        fp32 = [Flat.of(osd["single_partition_of_fp32_groups"][g], torch.float32) for osd in osds]
        full = Flat.cat(fp32)
        states: dict[str, Flat] = {}
        scalars: dict[str, Any] = {}
        per_rank = [(osd["base_optimizer_state"].get("state") or {}).get(g, {}) for osd in osds]
        for key, value in per_rank[0].items():
            if is_tensor(value) and value.dim() >= 1:
                # each rank's moment may keep the tail padding its fp32 slice dropped
                states[key] = Flat.cat([Flat.of(r[key]).slice(0, f.numel()) for r, f in zip(per_rank, fp32)])
            else:
                scalars[key] = optimizer_scalar(paths[0], value, key)
        _cut(imp, paths[0], shapes, full, states, scalars)


def _flat_stage3(imp: Imported, paths: list[str], osds: list[dict], groups_shapes: list[dict]) -> None:
    """Stage 3: each rank holds, per parameter in order, ceil(n/world) elements (padded)."""
    import torch

    world = len(osds)
    names = [(n, s) for shapes in groups_shapes for n, s in shapes.items()]
    flat = [Flat.cat([Flat.of(t, torch.float32) for t in osd["fp32_flat_groups"]], torch.float32) for osd in osds]
    per_rank_states = [osd["optimizer_state_dict"].get("state") or {} for osd in osds]
    keys = {}
    for gstate in per_rank_states[0].values():
        for key, value in gstate.items():
            keys[key] = is_tensor(value) and value.dim() >= 1
    moments = {k: [Flat.cat([Flat.of(s[g][k]) for g in sorted(s)]) for s in per_rank_states]
               for k, per_elem in keys.items() if per_elem}
    first_group = per_rank_states[0][min(per_rank_states[0])]
    scalars = {k: optimizer_scalar(paths[0], first_group[k], k) for k, per_elem in keys.items()
               if not per_elem}
    need = sum(math.ceil(math.prod(s) / world) for _, s in names)
    for what, per in [("fp32_flat_groups", flat), *moments.items()]:
        if any(f.numel() < need for f in per):
            raise CheckpointError(paths[0], f"{what} hold {min(f.numel() for f in per)} elements per rank, "
                                            f"param_shapes need {need}")
    offset = 0
    for name, shape in names:
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        imp.params[name] = Flat.cat([f.slice(offset, offset + part) for f in flat]).slice(0, numel).tensor(
            tuple(shape), torch_zip.LAZY_BYTES)
        imp.optimizer_state[name] = {
            k: Flat.cat([m.slice(offset, offset + part) for m in per]).slice(0, numel).tensor((numel,),
                                                                                            torch_zip.LAZY_BYTES)
            for k, per in moments.items()}
        imp.scalar_state[name] = dict(scalars)
        offset += part


def _cut(imp: Imported, where: str, shapes: dict, full: Flat, states: dict[str, Flat], scalars: dict) -> None:
    """Params of one group, in param_shapes order, from the group's full flat fp32 run."""
    need = sum(math.prod(shape) for shape in shapes.values())
    for what, flat in [("the fp32 partitions", full), *states.items()]:
        if need > flat.numel():
            raise CheckpointError(where, f"{what} hold {flat.numel()} elements, param_shapes need more ({need})")
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        imp.params[name] = full.slice(offset, offset + numel).tensor(tuple(shape), torch_zip.LAZY_BYTES)
        imp.optimizer_state[name] = {k: v.slice(offset, offset + numel).tensor((numel,), torch_zip.LAZY_BYTES)
                                     for k, v in states.items()}
        imp.scalar_state[name] = dict(scalars)
        offset += numel
