"""What every DeepSpeed layout shares: the model-states file (param_shapes, buffers, ties,
counters, config, client state), the param groups, checked fields, and HF Trainer's
trainer_state.json. Used by deepspeed_ckpt.py (per-rank ZeRO files) and
deepspeed_universal.py (ds_to_universal folders)."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.format.training_state import scalar_json, to_json_value
from zeroshard.interop import files, torch_zip
from zeroshard.interop.imported import (
    Flat,
    Imported,
    LazyTensor,
    holds_tensors,
    is_tensor,
    optimizer_class_of,
    with_shape,
)
from zeroshard.interop.torch_pickle import MAX_NESTING, nesting_depth

# Keys of DeepSpeed's model-states dict; everything else in it is the user's client_state.
DS_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
           "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
           "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
           "ds_version", "checkpoint_parallel_dimensions", "moe_layers", "autoep_layers", "ds_autoep_layers",
           "universal_checkpoint_info"}
MAX_DIMS = 64


def int_field(where: str, value: Any, what: str, default: int = 0) -> int:
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
    if hasattr(value, "dim") and value.dim() == 0 and not value.is_floating_point() and value.dtype.is_signed:
        value = value.item()  # an integer tensor step: torch's optimizers make theirs float32
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or abs(value) > 2**53:
            raise CheckpointError(where, f"optimizer state {key!r} is {value!r}, not a usable scalar")
        return {"dtype": "F32", "value": float(value)}
    return scalar_json(value, f"optimizer state {key!r}")


def check_param_shapes(where: str, groups_shapes: Any) -> list[dict[str, tuple[int, ...]]]:
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


def load_model_states(model_path: str, folder: str) -> tuple[dict, list[dict[str, tuple[int, ...]]], dict | None]:
    """(model-states dict, checked param_shapes, ds_config) of the file at `model_path`; ds_config
    None: the checkpoint does not hold the writer's config (see writer_config)."""
    if not files.isfile(model_path):
        raise CheckpointError(model_path, "missing: the model-states file of this checkpoint")
    model = torch_zip.load_lazy(model_path, folder)  # stage 1-2's module weights stay unread
    if not isinstance(model, dict) or "param_shapes" not in model or "buffer_names" not in model:
        raise CheckpointError(model_path, "not a DeepSpeed model-states file (no param_shapes/buffer_names)")
    if nesting_depth(model) > MAX_NESTING:
        raise CheckpointError(model_path, f"nested deeper than {MAX_NESTING} levels (client_state?)")
    groups_shapes = check_param_shapes(model_path, model["param_shapes"])
    return model, groups_shapes, writer_config(model_path, model.get("ds_config"))


def writer_config(model_path: str, saved: Any) -> dict | None:
    """The config DeepSpeed trained with, as its engine saved it: a dict, or (releases before it
    loaded the config itself: 0.18.0 did not, 0.18.9 did) whatever `initialize` was given: the path of a
    JSON file (`--deepspeed_config ds_config.json`, DeepSpeed's launcher recipe), which the
    checkpoint does not hold (None), or a base64-encoded JSON config, which it does."""
    if saved is None or isinstance(saved, dict):
        return saved or {}
    if not isinstance(saved, str):
        raise CheckpointError(model_path, f"ds_config must be a dict or a string, got {type(saved).__name__}")
    try:  # DeepSpeedConfig's own rule: a string that is not a file is base64 of JSON
        decoded = json.loads(base64.urlsafe_b64decode(saved.encode("ascii")).decode("utf-8"))
    except (ValueError, UnicodeError):
        return None
    return decoded if isinstance(decoded, dict) else None


def loss_scale_of(scaler: Any) -> dict[str, Any]:
    """DeepSpeed's (Dynamic)LossScaler as the engine's loss-scaler state (engine/precision.py
    follows its rules): saved after iteration cur_iter - 1, the good steps since its last
    overflow are cur_iter - last_overflow_iter - 1. (A count of 0 restarted the window: up to a
    window of steps at too small a scale, and steps DeepSpeed would skip applied.)"""
    def whole(name: str, default: int) -> int:
        value = getattr(scaler, name, default)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    good = whole("cur_iter", 0) - whole("last_overflow_iter", -1) - 1
    return {"scale": float(scaler.cur_scale), "good_steps": max(good, 0),
            "hysteresis_left": whole("cur_hysteresis", 0)}


def group_members(where: str, groups_shapes: list[dict], param_groups: Any) -> list[dict]:
    """{name: shape} of each optimizer param group. param_shapes lists DeepSpeed's flat groups;
    at stage 3 a param group is cut into several once its partition exceeds `sub_group_size`, and
    the optimizer's param group then names its flat groups by index in `params` (stages 1-2 and
    uncut groups: one each, in order)."""
    if not param_groups:
        return groups_shapes
    if not isinstance(param_groups, (list, tuple)) or not all(isinstance(g, dict) for g in param_groups):
        raise CheckpointError(where, "the optimizer's param_groups are not a list of dicts")
    indices = [g.get("params") for g in param_groups]
    flat = [i for members in indices if isinstance(members, (list, tuple)) for i in members]
    if all(isinstance(m, (list, tuple)) for m in indices) and all(type(i) is int for i in flat) \
            and sorted(flat) == list(range(len(groups_shapes))):
        return [{n: s for i in members for n, s in groups_shapes[i].items()} for members in indices]
    if len(param_groups) == len(groups_shapes):
        return groups_shapes
    raise CheckpointError(where, f"param_shapes list {len(groups_shapes)} flat groups; the optimizer's "
                                 f"{len(param_groups)} param groups do not say which of them each holds")


def fill_from_model(imp: Imported, folder: str, model_path: str, model: dict, groups_shapes: list[dict],
                    ds_config: dict | None, param_groups: Any, loss_scaler: Any,
                    frozen_fragments: dict[str, Any] | None = None) -> None:
    """Everything but the tensors of the optimizer files: hyperparameters (`param_groups`, the
    optimizer's saved list), buffers, frozen parameters (`frozen_fragments`: stage 3's, gathered
    over the ranks' files; else from `model`), ties, counters, dtypes, loss scale, scheduler,
    client state. ds_config None (a config file's path was saved): what the config would say is
    taken from the files (the compute dtype from the saved module's parameters), with a note."""
    _note_clipping_default(imp, model, ds_config)
    if ds_config is None:
        imp.notes.append(f"ds_config is {str(model.get('ds_config'))[:200]!r}, the path DeepSpeed read its config "
                         "from, not the config: gradient_accumulation_steps is taken as 1 (micro_steps only; a "
                         "resume starts a new window) and the compute dtype from the saved parameters")
        ds_config = {}
        _dtype_from_module(imp, model)
    hyper = []
    members = group_members(model_path, groups_shapes, param_groups)
    for g, shapes in enumerate(members):
        saved = dict((param_groups or [{}] * len(members))[g])
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
    imp.optimizer_class = optimizer_class_of(hyper, declared, imp.notes)

    module = model.get("module") or {}
    imp.buffers = {n: module[n].materialize() if isinstance(module[n], LazyTensor) else module[n].detach().clone()
                   for n in model["buffer_names"] if n in module}
    carry_frozen(imp, model_path, model, frozen_fragments)
    ties = {str(k): str(v) for k, v in (model.get("shared_params") or {}).items()}
    if imp.zero_stage >= 2 and model.get("frozen_param_shapes") is None:
        _note_frozen_excluded(imp, module, ties)
    imp.aliases = {alias: target for alias, target in ties.items() if target in imp.params}
    known = set(imp.params) | set(imp.buffers) | set(imp.aliases)
    untied = [k for k in module if k not in known and _holds_data(module[k])]
    if untied:  # stage 3 only (stages 1-2 carry every other module tensor as frozen): a layout not understood
        raise CheckpointError(model_path, f"module tensors neither parameters, buffers, frozen parameters nor "
                                          f"recorded ties: {', '.join(untied[:6])}{' ...' if len(untied) > 6 else ''}; "
                                          "importing without them would lose them")

    imp.global_steps = int_field(model_path, model.get("global_steps"), "global_steps")
    imp.skipped_steps = int_field(model_path, model.get("skipped_steps"), "skipped_steps")
    accumulation = int_field(model_path, ds_config.get("gradient_accumulation_steps"),
                             "ds_config.gradient_accumulation_steps", 1)
    imp.micro_steps = imp.global_steps * accumulation
    if (ds_config.get("bf16") or {}).get("enabled") or (ds_config.get("bfloat16") or {}).get("enabled"):
        imp.compute_dtype = "BF16"
    elif (ds_config.get("fp16") or {}).get("enabled"):
        imp.compute_dtype = "F16"
    if loss_scaler is not None and getattr(loss_scaler, "cur_scale", None) is not None:
        imp.loss_scale = loss_scale_of(loss_scaler)
    try:
        scheduler = to_json_value(model.get("lr_scheduler"), "lr_scheduler")
    except TypeError:
        imp.notes.append("the lr_scheduler state is not plain data and was left out")
    else:
        if scheduler is not None:
            imp.stateful["lr_scheduler"] = scheduler
    client = {}
    for key, value in model.items():
        if key in DS_KEYS:
            continue
        try:
            client[str(key)] = to_json_value(value, f"client_state[{key!r}]")
        except TypeError as exc:
            if holds_tensors(value):  # model data (an EMA copy, say): never dropped with a note
                raise CheckpointError(model_path, f"client_state[{str(key)[:80]!r}] holds tensors, which a zeroshard "
                                                  "client state (JSON) cannot carry; importing without them would "
                                                  "lose them") from None
            imp.notes.append(f"{exc}: left out")
    imp.client_state = client


def _note_frozen_excluded(imp: Imported, module: dict, ties: dict[str, str]) -> None:
    """save_checkpoint(exclude_frozen_parameters=True), which the HF Trainer uses for PEFT models:
    stages 2-3 then record no frozen_param_shapes and the module state dict drops frozen
    parameters by name, but not a tied copy of one, which still holds its value: carried as the
    parameter it is tied to, not dropped."""
    recovered = []
    for alias, target in ties.items():
        value = module.get(alias)
        if target not in imp.params and target not in imp.buffers and _holds_data(value):
            imp.params[target] = with_shape(value, tuple(value.shape))
            recovered.append(f"{target} (from its tied copy {alias})")
    imp.notes.append("saved with exclude_frozen_parameters (the HF Trainer does so for PEFT models): the frozen "
                     "parameters are not in this checkpoint, only the trainable ones"
                     + (f" and {', '.join(recovered)}" if recovered else "")
                     + "; resume by loading it with strict=False into the model built from its base weights")


def carry_frozen(imp: Imported, model_path: str, model: dict, fragments: dict[str, Any] | None) -> None:
    """Parameters DeepSpeed's optimizer does not hold (requires_grad False, or no elements) exist
    only in the model-states file: as `frozen_param_shapes` + `frozen_param_fragments` (stages 2-3;
    stage 3's fragments are per rank, gathered by the caller) or, at stage 1, only in the module
    state dict, as every module tensor that is no trainable parameter, buffer or recorded tie.
    Carried as parameters without optimizer state, as the engine saves its own frozen ones."""
    module = model.get("module") or {}
    declared = model.get("frozen_param_shapes")
    # stage 1 (DeepSpeed records frozen parameters from stage 2 on), or saved with
    # exclude_frozen_parameters (then only tied copies of frozen ones can be here: _note_frozen_excluded)
    if declared is None:
        ties, buffers = set(model.get("shared_params") or {}), set(model["buffer_names"])
        declared = {k: tuple(v.shape) for k, v in module.items()  # (stage 3's empty placeholders: never)
                    if k not in imp.params and k not in buffers and k not in ties and is_tensor(v)
                    and (imp.zero_stage < 3 or v.numel() > 0)}
    shapes = check_param_shapes(model_path, [declared])[0]
    if fragments is None:
        fragments = model.get("frozen_param_fragments") or {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        value = next((v for v in (fragments.get(name), module.get(name)) if is_tensor(v) and v.numel() == numel), None)
        if value is None:
            raise CheckpointError(model_path, f"frozen parameter {name!r} of shape {list(shape)} has no saved value "
                                              "of that size; importing without it would lose it")
        if name in imp.params or name in imp.buffers:
            what = "trainable" if name in imp.params else "buffer"
            raise CheckpointError(model_path, f"{name!r} is listed both as a {what} and as a frozen parameter")
        imp.params[name] = with_shape(value, shape)


def gather_frozen_stage3(folder: str, world: int, model_path: str, model: dict) -> dict[str, Any]:
    """Stage 3's frozen parameters, whole: each rank's model-states file in `folder` holds, per
    frozen parameter, that rank's ceil(n/world) slice (padded), as the trainable ones are cut
    (`model`: rank 0's, read already)."""
    import torch

    shapes = check_param_shapes(model_path, [model.get("frozen_param_shapes") or {}])[0]
    if not shapes:
        return {}
    per_rank = []
    for rank in range(world):
        path = files.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        states = model if rank == 0 else torch_zip.load_lazy(path, folder) if files.isfile(path) else None
        if not isinstance(states, dict):
            raise CheckpointError(path, "missing or not a model-states file: it holds this rank's slices of the "
                                        "frozen parameters")
        per_rank.append((path, states.get("frozen_param_fragments") or {}))
    whole = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        pieces = []
        for path, fragments in per_rank:
            piece = fragments.get(name)
            if not is_tensor(piece) or piece.numel() != part:
                raise CheckpointError(path, f"frozen parameter {name!r}: expected this rank's slice of {part} "
                                            f"elements, got {'none' if piece is None else piece.numel()}")
            pieces.append(Flat.of(piece, torch.float32))
        whole[name] = Flat.cat(pieces, torch.float32).slice(0, numel).tensor(tuple(shape), torch_zip.LAZY_BYTES)
    return whole


def _holds_data(value: Any) -> bool:
    """A module tensor with elements (stage 3 saves parameters there as empty placeholders)."""
    return is_tensor(value) and value.numel() > 0


def _dtype_from_module(imp: Imported, model: dict) -> None:
    """The compute dtype of a run whose config is not in its checkpoint: DeepSpeed saves the
    module's parameters in it (stage 3: their empty placeholders, of the same dtype)."""
    import torch

    names = {str(n) for shapes in (model.get("param_shapes") or []) if isinstance(shapes, dict) for n in shapes}
    module = model.get("module") or {}
    dtypes = {module[n].dtype for n in names if n in module and is_tensor(module[n])}
    if len(dtypes) == 1:
        imp.compute_dtype = {torch.bfloat16: "BF16", torch.float16: "F16"}.get(dtypes.pop(), "F32")


CLIPPING_DEFAULT_CHANGED = (0, 19, 3)  # DeepSpeed's GRADIENT_CLIPPING_DEFAULT: 0.0 before, 1.0 from this release


def _note_clipping_default(imp: Imported, model: dict, ds_config: dict | None) -> None:
    """A run that left gradient_clipping to a DeepSpeed before 0.19.3 did not clip; the same config
    clips at 1.0 under zeroshard.deepspeed (as under DeepSpeed >= 0.19.3): said, not changed, since
    the config a resume uses is the user's."""
    version = str(model.get("ds_version") or "")
    parts = [int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit()]
    if len(parts) < 2 or tuple(parts) >= CLIPPING_DEFAULT_CHANGED or (ds_config and "gradient_clipping" in ds_config):
        return
    why = ("its config did not set gradient_clipping, so" if ds_config is not None
           else "if its config file did not set gradient_clipping,")
    imp.notes.append(f"written by DeepSpeed {version}: {why} that run did not clip gradients (the default was 0.0 "
                     "before DeepSpeed 0.19.3); zeroshard.deepspeed, like DeepSpeed 0.19.3 and later, clips at 1.0 "
                     "by default: set \"gradient_clipping\": 0.0 to train on as before")
