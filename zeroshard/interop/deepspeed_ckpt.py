"""Reading a DeepSpeed ZeRO 1/2/3 checkpoint folder into an Imported.

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
Only data-parallel checkpoints (mp_rank_00 only, no pipeline) are read.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.format.training_state import scalar_json, to_json_value
from zeroshard.interop.imported import Imported, optimizer_class_of
from zeroshard.interop.torch_pickle import MAX_NESTING, load_pt, nesting_depth, read_small_file

# Keys of DeepSpeed's model-states dict; everything else in it is the user's client_state.
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
           "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
           "ds_version", "checkpoint_parallel_dimensions", "moe_layers", "autoep_layers", "ds_autoep_layers"}
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MAX_LATEST_BYTES = 4096  # `latest` holds one tag name
MAX_DIMS = 64


def _int_field(where: str, value: Any, what: str, default: int = 0) -> int:
    """An integer field of a DeepSpeed file (a 0-d tensor or int); CheckpointError naming `where` otherwise."""
    if value is None:
        return default
    if hasattr(value, "dim") and value.dim() == 0 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(where, f"{what} must be an integer, got {type(value).__name__} {str(value)[:40]!r}")
    return value


def optimizer_scalar(where: str, value: Any, key: str) -> dict[str, Any]:
    """A scalar optimizer state in the form torch's optimizers keep it: a 0-d float32 tensor.
    DeepSpeedCPUAdam (offload_optimizer) keeps Adam's `step` as a Python int; written as an int,
    torch's AdamW refuses it at the first step() ("state_steps ... singleton tensors")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or abs(value) > 2**53:
            raise CheckpointError(where, f"optimizer state {key!r} is {value!r}, not a usable scalar")
        return {"dtype": "F32", "value": float(value)}
    return scalar_json(value, f"optimizer state {key!r}")


def _check_param_shapes(where: str, groups_shapes: Any) -> list[dict[str, tuple[int, ...]]]:
    """param_shapes: a list of {name: shape}, every dimension a non-negative integer; bounded
    here so no absurd or negative size reaches an allocation."""
    if not isinstance(groups_shapes, (list, tuple)):
        raise CheckpointError(where, f"param_shapes must be a list of groups, got {type(groups_shapes).__name__}")
    checked = []
    for g, shapes in enumerate(groups_shapes):
        if not isinstance(shapes, dict):
            raise CheckpointError(where, f"param_shapes[{g}] must be a dict of name -> shape")
        group = {}
        for name, shape in shapes.items():
            if not isinstance(name, str):
                raise CheckpointError(where, f"param_shapes[{g}] has a non-string name {name!r}")
            dims = tuple(shape) if isinstance(shape, (list, tuple)) else None
            if dims is None or len(dims) > MAX_DIMS or any(isinstance(d, bool) or not isinstance(d, int) or d < 0
                                                           for d in dims):
                raise CheckpointError(where, f"param_shapes[{g}][{name!r}]: {str(shape)[:60]} is not a shape "
                                             "(non-negative integer dimensions)")
            group[name] = dims
        checked.append(group)
    return checked


def resolve_tag_folder(src: str) -> str:
    """`src` itself if it holds DeepSpeed rank files, else the folder its `latest` names."""
    if not os.path.isdir(src):
        raise CheckpointError(src, "no such DeepSpeed checkpoint folder")
    if any(_OPTIM.match(name) for name in os.listdir(src)):  # listdir, not glob: `lr[3e-4]` is a plain name
        return src
    latest = os.path.join(src, "latest")
    if os.path.lexists(latest):
        raw = read_small_file(latest, MAX_LATEST_BYTES)
        try:
            tag = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CheckpointError(latest, "is not UTF-8 text (it should name the tag folder)") from None
        folder = os.path.join(src, tag)
        if os.sep in tag or "\0" in tag or tag in ("", ".", "..") or not os.path.isdir(folder) \
                or os.path.islink(folder):
            raise CheckpointError(latest, f"names {tag!r}, which is not a checkpoint folder inside {src}")
        return folder
    raise CheckpointError(src, "not a DeepSpeed checkpoint: no *_optim_states.pt files and no 'latest'")


def _optim_files(folder: str) -> list[str]:
    found = {}
    prefixes = set()
    for name in os.listdir(folder):
        m = _OPTIM.match(name)
        if m:
            if int(m.group(2)) != 0:
                raise CheckpointError(os.path.join(folder, name),
                                      "model-parallel checkpoints (mp_rank > 0) are not supported")
            found[int(m.group(1))] = os.path.join(folder, name)
            prefixes.add(name.startswith("bf16_"))
    if len(prefixes) > 1:  # two saves in one folder: which is this checkpoint's is not ours to guess
        raise CheckpointError(folder, "holds both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files")
    if not found or sorted(found) != list(range(len(found))):
        raise CheckpointError(folder, f"expected zero_pp_rank_0..N-1 optimizer files, found ranks {sorted(found)}")
    return [found[r] for r in range(len(found))]


def read_deepspeed(src: str) -> Imported:
    """Read the DeepSpeed checkpoint at `src` (a root with `latest`, or a tag folder)."""
    folder = resolve_tag_folder(src)
    try:
        return _read(folder)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError, RuntimeError) as exc:  # a layout unknown
        raise CheckpointError(folder, f"unexpected DeepSpeed checkpoint layout ({type(exc).__name__}: {exc}); "
                                      "ZeRO 1/2/3 data-parallel checkpoints are supported") from None


def _read(folder: str) -> Imported:
    optim_paths = _optim_files(folder)
    world = len(optim_paths)
    optims = [load_pt(p, folder) for p in optim_paths]
    osds = []
    for path, sd in zip(optim_paths, optims):
        if not isinstance(sd, dict) or not isinstance(sd.get("optimizer_state_dict"), dict):
            raise CheckpointError(path, "not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict)")
        osds.append(sd["optimizer_state_dict"])
    stage = _int_field(optim_paths[0], osds[0].get("zero_stage"), "zero_stage", -1)
    if stage == -1 and os.path.basename(optim_paths[0]).startswith("bf16_") \
            and "single_partition_of_fp32_groups" in osds[0]:
        stage = 1  # DeepSpeed's BF16_Optimizer (bf16 at ZeRO 1) records no stage; its layout is stage 1's
    if stage not in (1, 2, 3):
        raise CheckpointError(optim_paths[0], f"unsupported ZeRO stage {stage} (1, 2 or 3 expected)")
    parts = osds[0].get("partition_count")
    parts = max(parts) if isinstance(parts, list) and parts else parts
    parts = _int_field(optim_paths[0], parts, "partition_count", -1)
    if parts != world:
        raise CheckpointError(folder, f"the optimizer files say {parts} partitions but {world} files are present")

    model_path = os.path.join(folder, "mp_rank_00_model_states.pt" if stage < 3
                              else "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if not os.path.isfile(model_path):
        raise CheckpointError(model_path, "missing: the model-states file of this checkpoint")
    model = load_pt(model_path, folder)
    if not isinstance(model, dict) or "param_shapes" not in model or "buffer_names" not in model:
        raise CheckpointError(model_path, "not a DeepSpeed model-states file (no param_shapes/buffer_names)")
    if nesting_depth(model) > MAX_NESTING:
        raise CheckpointError(model_path, f"nested deeper than {MAX_NESTING} levels (client_state?)")
    groups_shapes = _check_param_shapes(model_path, model["param_shapes"])
    ds_config = model.get("ds_config") or {}
    if not isinstance(ds_config, dict):
        raise CheckpointError(model_path, f"ds_config must be a dict, got {type(ds_config).__name__}")
    imp = Imported(source=f"deepspeed:{os.path.abspath(folder)}", params={}, zero_stage=stage, world_size=world)

    if stage < 3:
        _flat_stage12(imp, optim_paths, osds, groups_shapes)
    else:
        _flat_stage3(imp, optim_paths, osds, groups_shapes)

    base = osds[0].get("base_optimizer_state" if stage < 3 else "optimizer_state_dict") or {}
    hyper = []
    for g, shapes in enumerate(groups_shapes):
        saved = dict((base.get("param_groups") or [{}] * len(groups_shapes))[g])
        saved.pop("params", None)
        group = {k: to_json_value(v, f"param group option {k!r}") for k, v in saved.items()}
        if group.get("bias_correction") is False:  # DeepSpeed's (CPU/Fused)Adam option; torch's always corrects
            raise CheckpointError(folder, f"param group {g} has bias_correction false, which torch's Adam cannot "
                                          "reproduce")
        group["params"] = list(shapes)
        hyper.append(group)
    imp.param_groups = hyper
    declared = str((ds_config.get("optimizer") or {}).get("type", ""))
    if declared.lower() == "adam" and (ds_config["optimizer"].get("params") or {}).get("adam_w_mode", True):
        declared = "AdamW"  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    imp.optimizer_class = optimizer_class_of(hyper, declared)

    module = model.get("module") or {}
    imp.buffers = {n: module[n].detach().clone() for n in model["buffer_names"] if n in module}
    imp.aliases = {str(k): str(v) for k, v in (model.get("shared_params") or {}).items() if v in imp.params}
    known = set(imp.params) | set(imp.buffers) | set(imp.aliases) | set(model.get("frozen_param_shapes") or {})
    untied = [k for k in module if k not in known]
    if untied:
        imp.notes.append(f"not recorded as tied by DeepSpeed, left out: {', '.join(untied)}")
    if model.get("frozen_param_shapes"):
        imp.notes.append("frozen parameters were left out: " + ", ".join(model["frozen_param_shapes"]))

    imp.global_steps = _int_field(model_path, model.get("global_steps"), "global_steps")
    imp.skipped_steps = _int_field(model_path, model.get("skipped_steps"), "skipped_steps")
    accumulation = _int_field(model_path, ds_config.get("gradient_accumulation_steps"),
                              "ds_config.gradient_accumulation_steps", 1)
    imp.micro_steps = imp.global_steps * accumulation
    if (ds_config.get("bf16") or {}).get("enabled") or (ds_config.get("bfloat16") or {}).get("enabled"):
        imp.compute_dtype = "BF16"
    elif (ds_config.get("fp16") or {}).get("enabled"):
        imp.compute_dtype = "F16"
    scaler = osds[0].get("loss_scaler")
    if scaler is not None and getattr(scaler, "cur_scale", None) is not None:
        imp.loss_scale = {"scale": float(scaler.cur_scale), "good_steps": 0,
                          "hysteresis_left": int(getattr(scaler, "cur_hysteresis", 0) or 0)}
    try:
        imp.lr_scheduler = to_json_value(model.get("lr_scheduler"), "lr_scheduler")
    except TypeError:
        imp.notes.append("the lr_scheduler state is not plain data and was left out")
    client = {}
    for key, value in model.items():
        if key in DS_KEYS:
            continue
        try:
            client[str(key)] = to_json_value(value, f"client_state[{key!r}]")
        except TypeError as exc:
            imp.notes.append(f"{exc}: left out")
    imp.client_state = client
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
        fp32 = [osd["single_partition_of_fp32_groups"][g].float() for osd in osds]
        full = torch.cat(fp32)
        states: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        per_rank = [(osd["base_optimizer_state"].get("state") or {}).get(g, {}) for osd in osds]
        for key, value in per_rank[0].items():
            if torch.is_tensor(value) and value.dim() >= 1:
                # each rank's moment may keep the tail padding its fp32 slice dropped
                states[key] = torch.cat([r[key].reshape(-1)[: f.numel()] for r, f in zip(per_rank, fp32)])
            else:
                scalars[key] = optimizer_scalar(paths[0], value, key)
        _cut(imp, paths[0], shapes, full, states, scalars)


def _flat_stage3(imp: Imported, paths: list[str], osds: list[dict], groups_shapes: list[dict]) -> None:
    """Stage 3: each rank holds, per parameter in order, ceil(n/world) elements (padded)."""
    import torch

    world = len(osds)
    names = [(n, s) for shapes in groups_shapes for n, s in shapes.items()]
    flat = [torch.cat([t.float().reshape(-1) for t in osd["fp32_flat_groups"]]) for osd in osds]
    per_rank_states = [osd["optimizer_state_dict"].get("state") or {} for osd in osds]
    keys = {}
    for gstate in per_rank_states[0].values():
        for key, value in gstate.items():
            keys[key] = torch.is_tensor(value) and value.dim() >= 1
    moments = {k: [torch.cat([s[g][k].reshape(-1) for g in sorted(s)]) for s in per_rank_states]
               for k, per_elem in keys.items() if per_elem}
    first_group = per_rank_states[0][min(per_rank_states[0])]
    scalars = {k: optimizer_scalar(paths[0], first_group[k], k) for k, per_elem in keys.items()
               if not per_elem}
    need = sum(math.ceil(math.prod(s) / world) for _, s in names)
    if any(f.numel() < need for f in flat):
        raise CheckpointError(paths[0], f"fp32_flat_groups hold {flat[0].numel()} elements per rank, "
                                        f"param_shapes need {need}")
    offset = 0
    for name, shape in names:
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        imp.params[name] = torch.cat([f[offset:offset + part] for f in flat])[:numel].reshape(tuple(shape)).clone()
        imp.optimizer_state[name] = {k: torch.cat([m[offset:offset + part] for m in per])[:numel].clone()
                                     for k, per in moments.items()}
        imp.scalar_state[name] = dict(scalars)
        offset += part


def _cut(imp: Imported, where: str, shapes: dict, full: Any, states: dict, scalars: dict) -> None:
    """Params of one group, in param_shapes order, from the group's full flat fp32 buffer."""
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if offset + numel > full.numel():
            raise CheckpointError(where, f"the fp32 partitions hold {full.numel()} elements, param_shapes need more")
        imp.params[name] = full[offset:offset + numel].reshape(tuple(shape)).clone()
        imp.optimizer_state[name] = {k: v[offset:offset + numel].clone() for k, v in states.items()}
        imp.scalar_state[name] = dict(scalars)
        offset += numel
