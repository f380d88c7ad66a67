"""Reading a DeepSpeed Universal Checkpoint folder (deepspeed.checkpoint.ds_to_universal's output).

Layout (DeepSpeed 0.19.8; deepspeed/checkpoint/universal_checkpoint.py is the reference reader):
  ROOT/latest_universal               names the folder (ds_to_universal writes it beside OUT)
  UNI/mp_rank_00_model_states.pt      copied from the source (stage 3: zero_pp_rank_R_...): param_shapes,
                                      buffers, ties, counters, ds_config, client state
  UNI/zero/optimizer_state.pt         the optimizer file's plain fields: param_groups, zero_stage,
                                      partition_count, loss_scaler, ...
  UNI/zero/<param>/fp32.pt            {"param": the full fp32 tensor, "cat_dim": ...}
  UNI/zero/<param>/<state>.pt         exp_avg, exp_avg_sq in the same form; step.pt a 0-d tensor
Stage 3's conversion differs: the state files hold bare tensors, there is no step.pt, and
optimizer_state.pt is rank 0's whole optimizer file; its state[first sub-group]["step"] is the
step of every parameter (as DeepSpeed's own stage-3 universal load takes it).
Tensors are whole (no rank slices). Parameters are param_shapes' names; module entries without
optimizer state (tied weights, buffers) also get a zero/<name>/fp32.pt, which is not read:
buffers and ties come from the model-states file as in a per-rank save.
"""

from __future__ import annotations

import math
import re
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.interop import files, torch_zip
from zeroshard.interop.deepspeed_common import (
    fill_from_model,
    gather_frozen_stage3,
    group_members,
    int_field,
    load_model_states,
    optimizer_scalar,
)
from zeroshard.interop.imported import Imported, is_tensor, with_shape
from zeroshard.interop.torch_pickle import MAX_NESTING, nesting_depth

_STATE_FILE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]{0,99})\.pt$")
MAX_WORLD = 1 << 16  # the output's default rank count comes from partition_count: bounded, not trusted
MAX_STATES = 32  # state files per parameter (Adam has 3)


def is_universal_folder(folder: str) -> bool:
    return files.isfile(files.join(folder, "zero", "optimizer_state.pt"))


def _model_path(folder: str) -> str:
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if files.exists(files.join(folder, name)):
            return files.join(folder, name)
    raise CheckpointError(folder, "missing: mp_rank_00_model_states.pt (the model-states file ds_to_universal "
                                  "copies)")


def _tensor_of(path: str, value: Any, numel: int) -> Any:
    """The whole tensor of a universal state file ({"param": tensor, ...} or a bare tensor)."""
    tensor = value.get("param") if isinstance(value, dict) else value
    if not is_tensor(tensor):
        raise CheckpointError(path, f"holds {type(tensor).__name__}, not a tensor under 'param'")
    if tensor.numel() != numel:
        raise CheckpointError(path, f"holds {tensor.numel()} elements, param_shapes say {numel}")
    return tensor


def read_universal(folder: str) -> Imported:
    zero = files.join(folder, "zero")
    common_path = files.join(zero, "optimizer_state.pt")
    common = torch_zip.load_lazy(common_path, folder)
    if not isinstance(common, dict) or not isinstance(common.get("param_groups"), list):
        raise CheckpointError(common_path, "not a universal optimizer_state.pt (no param_groups list)")
    if nesting_depth(common) > MAX_NESTING:
        raise CheckpointError(common_path, f"nested deeper than {MAX_NESTING} levels")
    stage = int_field(common_path, common.get("zero_stage"), "zero_stage", 1)
    if stage not in (1, 2, 3):
        raise CheckpointError(common_path, f"unsupported ZeRO stage {stage} (1, 2 or 3 expected)")
    parts = common.get("partition_count")
    parts = max(parts) if isinstance(parts, list) and parts else parts
    world = int_field(common_path, parts, "partition_count", 1)
    if not 1 <= world <= MAX_WORLD:
        raise CheckpointError(common_path, f"partition_count {world} is not between 1 and {MAX_WORLD}")

    model_path = _model_path(folder)
    model, groups_shapes, ds_config = load_model_states(model_path, folder)
    group_members(common_path, groups_shapes, common["param_groups"])  # each flat group in one param group
    imp = Imported(source=f"deepspeed-universal:{files.absolute(folder)}", params={}, zero_stage=stage,
                   world_size=world)
    shared = _shared_scalars(common_path, common)
    for shapes in groups_shapes:
        for name, shape in shapes.items():
            _read_param(imp, folder, zero, name, shape)
            imp.scalar_state[name] = {**shared, **imp.scalar_state[name]}  # a per-parameter step.pt wins
    # stage 3's conversion copies every rank's model-states file: the frozen parameters' slices
    frozen = gather_frozen_stage3(folder, world, model_path, model) if stage == 3 else None
    fill_from_model(imp, folder, model_path, model, groups_shapes, ds_config, common["param_groups"],
                    common.get("loss_scaler"), frozen)
    return imp


def _shared_scalars(path: str, common: dict) -> dict[str, Any]:
    """Stage 3: the scalar states (step) of the first sub-group in optimizer_state.pt."""
    state = (common.get("optimizer_state_dict") or {}).get("state") or {}
    if not isinstance(state, dict) or not state:
        return {}
    first = state[min(state)]
    return {k: optimizer_scalar(path, v, k) for k, v in first.items() if getattr(v, "dim", lambda: 0)() == 0}


def _read_param(imp: Imported, folder: str, zero: str, name: str, shape: tuple[int, ...]) -> None:
    """One parameter's fp32 value and optimizer states from zero/<name>/."""
    where = files.join(zero, name)
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise CheckpointError(where, f"parameter name {name!r} cannot be a folder of this checkpoint")
    if not files.isdir(where) or not files.isfile(files.join(where, "fp32.pt")):
        raise CheckpointError(where, "missing: the parameter's fp32.pt")
    names = files.listdir(where)
    if len(names) > MAX_STATES:
        raise CheckpointError(where, f"holds {len(names)} files, more than the {MAX_STATES} optimizer states read")
    numel = math.prod(shape)
    states, scalars = {}, {}
    for file in names:
        path = files.join(where, file)
        m = _STATE_FILE.match(file)
        if not m:
            raise CheckpointError(path, "is not an optimizer state file (<state>.pt) of a universal checkpoint")
        value = torch_zip.load_lazy(path, folder)  # a big state stays unread until written
        key = m.group(1)
        if key == "fp32":
            imp.params[name] = with_shape(_tensor_of(path, value, numel).float(), tuple(shape))
        elif isinstance(value, dict) or getattr(value, "dim", lambda: 0)() >= 1:
            states[key] = with_shape(_tensor_of(path, value, numel), (numel,))
        else:
            scalars[key] = optimizer_scalar(path, value, key)
    imp.optimizer_state[name] = states
    imp.scalar_state[name] = scalars
