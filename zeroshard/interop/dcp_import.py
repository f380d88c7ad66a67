"""Reading a DCP checkpoint into an Imported, in one process, without a process group.

`.metadata` (dcp_metadata.py) lists every tensor's chunks and where each chunk's bytes are
(`storage_data`: file, offset, length); with torch's default writer each chunk is a small
torch.save blob, read here with weights_only=True from exactly that byte range. Non-tensor
values (param-group hyperparameters) are torch.save'd objects, read the same way.
`planner_data` gives each flat key its path; dcp_layouts.py decides from the paths which
layout this is (model under `model` or at the top level, optimizer nested or flattened under
`optim`/`optimizer`, torchtitan's extras) and refuses what fits none. An Accelerate
`save_state` folder (`pytorch_model_fsdp_0/` + `optimizer_0/`) is read as one checkpoint.

Parameters: with optimizer state, the parameters are what the optimizer covers; the other
model tensors are tied copies (equal to a parameter, not constant) or buffers. Without it
(model-only), every floating tensor is a parameter except tied copies and names matching
`buffers` (a regex, fullmatch); non-floating tensors are buffers.
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.format.training_state import scalar_json, to_json_value
from zeroshard.interop import dcp_chunks, files, megatron, torchtitan
from zeroshard.interop.accelerate_plain import OWN as ACCELERATE_PLAIN_OWN
from zeroshard.interop.accelerate_plain import AcceleratePlainSource
from zeroshard.interop.beside import SCHEDULER_KEY, carry_beside
from zeroshard.interop.dcp_layouts import Layout, classify
from zeroshard.interop.dcp_metadata import load_metadata
from zeroshard.interop.hf_folders import is_accelerate_plain, is_trainer_checkpoint, trainer_checkpoints
from zeroshard.interop.imported import Imported, LazyTensor, flat_range, materialize, optimizer_class_of
from zeroshard.interop.pickled_state import FlatSource, PickledSource
from zeroshard.interop.source import Option, Source
from zeroshard.interop.trainer_ddp import OWN, TrainerSource
from zeroshard.storage.location import Location


def _path_of(metadata: Any, key: str) -> tuple:
    planner = metadata.planner_data if isinstance(getattr(metadata, "planner_data", None), dict) else {}
    path = planner.get(key)
    if path:
        return tuple(path)
    head, _, rest = key.partition(".")
    return (head, rest)  # no planner data: model.<fqn> only


ACCELERATE_MODEL, ACCELERATE_OPTIMIZER = "pytorch_model_fsdp_0", "optimizer_0"
ACCELERATE_FULL_MODEL, ACCELERATE_FULL_OPTIMIZER = "pytorch_model_fsdp.bin", "optimizer.bin"  # FULL_STATE_DICT
_PER_RANK_PICKLE = re.compile(r"(?:pytorch_model_fsdp|optimizer)_\d+_rank\d+\.bin")  # SHARDED, use_dcp=False


class _Source:
    """One DCP folder: its checked metadata and the storage entry of each chunk."""

    kind = "dcp"

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.metadata = load_metadata(files.join(folder, ".metadata"))
        storage = getattr(self.metadata, "storage_data", None) or {}
        self.world_size = len({i.relative_path for i in storage.values()}) or 1  # one .distcp file per rank
        self.chunks = {(index.fqn, tuple(index.offset) if index.offset is not None else None): info
                       for index, info in storage.items()}

    def keys(self) -> list[str]:
        return list(self.metadata.state_dict_metadata)

    def path(self, key: str) -> tuple:
        return _path_of(self.metadata, key)

    def dims(self, key: str) -> int | None:
        """The tensor's number of dimensions; None for a pickled object."""
        entry = self.metadata.state_dict_metadata[key]
        return len(entry.size) if type(entry).__name__ == "TensorStorageMetadata" else None

    def read(self, key: str) -> Any:
        entry = self.metadata.state_dict_metadata[key]
        if type(entry).__name__ == "TensorStorageMetadata":
            return dcp_chunks.tensor(self.folder, key, entry, self.chunks)
        info = self.chunks.get((key, None)) or next((i for (k, _), i in self.chunks.items() if k == key), None)
        if info is None:
            raise CheckpointError(self.folder, f"{key}: no storage entry")
        return dcp_chunks.read_blob(self.folder, info, key)


def _has_metadata(folder: str) -> bool:
    return files.isfile(files.join(folder, ".metadata"))


def _sources(folder: str, param_names: list[str] | None = None) -> tuple[list[Any], list[str], list[str]]:
    """The DCP folders of checkpoint `folder` (one, or Accelerate's model + optimizer pair), notes,
    and the names of what else an Accelerate save_state folder holds (beside.py reads them).
    `param_names`: the optimizer's parameters in index order, for a plain Accelerate save_state."""
    if not files.isdir(folder):
        raise CheckpointError(folder, "no such DCP checkpoint folder")
    backend = megatron.backend_of(folder)
    if backend is not None:  # Megatron-Core's dist_checkpointing: its own keys and stacked layers
        raise CheckpointError(folder, f"a Megatron-Core dist checkpoint (sharded_backend {backend[:40]!r}): "
                                      "import it with `zeroshard import megatron`")
    if _has_metadata(folder):
        notes = []
        sibling = files.join(files.parent(folder), ACCELERATE_OPTIMIZER)
        if posixpath.basename(files.absolute(folder)) == ACCELERATE_MODEL and _has_metadata(sibling):
            notes.append(f"the optimizer state is in the sibling {ACCELERATE_OPTIMIZER}/, not imported: "
                         "import the folder holding both to take it")
        return [_Source(folder)], notes, []
    names = files.listdir(folder)
    if ACCELERATE_FULL_MODEL in names:
        return _full_state_sources(folder, names)
    if is_trainer_checkpoint(names):  # Hugging Face's Trainer without DeepSpeed or FSDP
        return [TrainerSource(folder, names)], [], [n for n in names if n not in OWN and not n.endswith(".safetensors")]
    if is_accelerate_plain(names):  # Accelerate's save_state without FSDP or DeepSpeed
        source = AcceleratePlainSource(folder, names, param_names)
        return [source], [f"optimizer.bin's parameter indices named by {source.named_by}"], \
            [n for n in names if n not in ACCELERATE_PLAIN_OWN]
    if not _has_metadata(files.join(folder, ACCELERATE_MODEL)):
        per_rank = next((n for n in names if _PER_RANK_PICKLE.fullmatch(n)), None)
        why = (f"; {per_rank} is a per-rank torch.save of DTensor shards (Accelerate's SHARDED_STATE_DICT with "
               "use_dcp=False), which is not read: save with DCP (the default) or FULL_STATE_DICT" if per_rank else "")
        runs = trainer_checkpoints(names)
        if runs and not why:
            why = f"; a Trainer's output folder? Name one of its checkpoints ({', '.join(runs[:4])})"
        raise CheckpointError(folder, f"not a DCP checkpoint: no .metadata file (nor Accelerate's "
                                      f"{ACCELERATE_MODEL}/.metadata or {ACCELERATE_FULL_MODEL}){why}")
    extra_models = [n for n in names if re.fullmatch(r"pytorch_model_fsdp_[1-9]\d*", n)]
    extra_optims = [n for n in names if re.fullmatch(r"optimizer_[1-9]\d*", n)]
    if extra_models or extra_optims:
        raise CheckpointError(folder, f"an Accelerate save_state of several models or optimizers "
                                      f"({', '.join(extra_models + extra_optims)}): only one of each is supported")
    sources = [_Source(files.join(folder, ACCELERATE_MODEL))]
    if _has_metadata(files.join(folder, ACCELERATE_OPTIMIZER)):
        sources.append(_Source(files.join(folder, ACCELERATE_OPTIMIZER)))
    return sources, [], [n for n in names if n not in (ACCELERATE_MODEL, ACCELERATE_OPTIMIZER)]


def _full_state_sources(folder: str, names: list[str]) -> tuple[list[Any], list[str], list[str]]:
    """Accelerate's FULL_STATE_DICT save_state (pickled_state.py): the model and optimizer files."""
    extra = [n for n in names if re.fullmatch(r"(?:pytorch_model_fsdp|optimizer)_[1-9]\d*\.bin", n)]
    if extra:
        raise CheckpointError(folder, f"an Accelerate save_state of several models or optimizers "
                                      f"({', '.join(sorted(extra))}): only one of each is supported")
    sources = [PickledSource(files.join(folder, ACCELERATE_FULL_MODEL), folder, "model")]
    if ACCELERATE_FULL_OPTIMIZER in names:
        sources.append(PickledSource(files.join(folder, ACCELERATE_FULL_OPTIMIZER), folder, "optimizer"))
    return sources, [], [n for n in names if n not in (ACCELERATE_FULL_MODEL, ACCELERATE_FULL_OPTIMIZER)]


def _buffer_pattern(buffers: str | None) -> re.Pattern | None:
    if not buffers:
        return None
    try:
        return re.compile(buffers)
    except re.error as exc:
        raise ZeroshardError(f"--buffers {buffers!r} is not a regular expression: {exc}") from None


def _constant(t: Any) -> bool:
    return t.numel() <= 1 or bool((t == t.reshape(-1)[0]).all())


PREFIX_ELEMENTS = 4096  # compared first: distinct weights differ there, so few tensors are read whole


def _tie_of(name: str, value: Any, params: dict[str, Any], prefixes: dict[str, Any]) -> str | None:
    """The parameter `value` is a tied copy of: equal elements, same shape and dtype, and not a
    constant (fresh norms and biases are equal without being the same parameter). Tensors may be
    lazy: their first elements are compared first (`prefixes` caches them by name)."""
    import torch

    if not value.is_floating_point():
        return None
    candidates = [p for p, t in params.items() if p != name and t.shape == value.shape and t.dtype == value.dtype]
    if not candidates:
        return None

    def head(key: str, t: Any) -> Any:
        if key not in prefixes:
            prefixes[key] = flat_range(t, 0, min(PREFIX_ELEMENTS, t.numel())).clone()
        return prefixes[key]

    mine = head("\0" + name, value)
    candidates = [p for p in candidates if torch.equal(head(p, params[p]), mine)]
    if not candidates:
        return None
    full = materialize(value)
    if _constant(full):
        return None
    return next((p for p in candidates if torch.equal(materialize(params[p]), full)), None)


def _flat_groups(folder: str, options: dict[str, dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """Param groups from a flattened optimizer (`param_groups.<fqn>.<k>`): it does not record
    which group a parameter was in nor the groups' order, so parameters with equal
    hyperparameters form one group, groups and members in the model's order."""
    groups: list[dict[str, Any]] = []
    for fqn in order:
        if fqn not in options:
            continue
        opts = {k: to_json_value(v, f"param group option {k!r} of {fqn}") for k, v in options[fqn].items()}
        same = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == opts), None)
        if same is None:
            groups.append({**opts, "params": [fqn]})
        else:
            same["params"].append(fqn)
    return groups


def _groups(folder: str, layout: Layout, nested: dict[int, dict[str, Any]], flat: dict[str, dict[str, Any]],
            order: list[str], notes: list[str]) -> list[dict[str, Any]]:
    """The param groups as JSON with `params` lists of FQNs, from either optimizer layout."""
    if layout.flattened:
        groups = _flat_groups(folder, flat, order)
        if groups:
            notes.append(f"param groups rebuilt from the flattened optimizer state: {len(groups)} group(s) of equal "
                         "hyperparameters, in model order (if your optimizer's groups differ, the engine keeps "
                         "its own hyperparameters on load)")
        return groups
    listless = [str(i) for i in sorted(nested) if not isinstance(nested[i].get("params"), (list, tuple))]
    if listless:
        raise CheckpointError(folder, f"param group(s) {', '.join(listless)} of '{layout.optimizer_prefix}' have "
                                      "no `params` list: which parameters they hold is unknown")
    return [{**{k: to_json_value(v, f"param group option {k!r}") for k, v in g.items() if k != "params"},
             "params": [str(n) for n in g["params"]]}
            for g in (nested[i] for i in sorted(nested))]


def read_dcp(src: str, buffers: str | None = None, storage_options: dict | None = None,
             param_names: list[str] | None = None, head_dim: int | None = None) -> Imported:
    """Read the DCP checkpoint folder `src` (or an Accelerate save_state folder), a local path or
    a URL (s3://; `storage_options` for its filesystem). `buffers`: a regex; model tensors whose
    name matches it in full are buffers, not parameters. `param_names`: the parameters of a plain
    Accelerate save_state's optimizer.bin in index order (accelerate_plain.py). `head_dim`: the
    attention head size of a torchtitan model with fused QKV (torchtitan.py). Tensors read
    later (LazyTensors) use the same storage options."""
    src = os.fspath(src)  # any os.PathLike
    with files.storage_options(storage_options):
        return _read_dcp(src, buffers, param_names, head_dim)


def recognise(location: Location, names: list[str]) -> str | None:
    """DCP's `.metadata` (FSDP2, torchtitan), Accelerate's FSDP folders and files, and what the
    Trainer and Accelerate save without DeepSpeed or FSDP (read here too)."""
    if ".metadata" in names or any(n.startswith("pytorch_model_fsdp") for n in names):
        return "a PyTorch DCP checkpoint (FSDP2, torchtitan or Accelerate)"
    if is_trainer_checkpoint(names):
        return "a Hugging Face Trainer checkpoint (no DeepSpeed or FSDP)"
    if is_accelerate_plain(names):
        return "an Accelerate save_state (no FSDP or DeepSpeed)"
    return None


SOURCE = Source(
    name="dcp", label="DCP (FSDP2)", recognise=recognise, read=read_dcp,
    options=(
        Option(("--buffers",), metavar="REGEX",
               help="Model tensors whose full name matches are buffers, not parameters (model-only sources)."),
        Option(("--param-names", "param_names"), kind="lines", metavar="FILE",
               help="An Accelerate save_state's optimizer.bin parameters in index order, one name a line."),
        Option(("--head-dim", "head_dim"), kind="int", metavar="N",
               help="A torchtitan model with fused QKV (wqkv): its attention head size, to fuse wq/wk/wv."),
    ),
    world_help="Ranks to write for (default: the source's, one per .distcp file).",
    help="""A torch.distributed.checkpoint folder: FSDP2's {"model", "optim"} (nested or flattened),
    {"model", "optimizer"}, model-only, a plain model state dict, torchtitan's checkpoints, or an
    Accelerate FSDP save_state folder (pytorch_model_fsdp_0/ + optimizer_0/, or with
    FULL_STATE_DICT pytorch_model_fsdp.bin + optimizer.bin), or a Hugging Face Trainer
    checkpoint-N/ written without DeepSpeed or FSDP (model.safetensors + optimizer.pt; needs the
    transformers release that saved it, to learn the order of optimizer.pt's parameters), or an
    Accelerate save_state without FSDP or DeepSpeed (model.safetensors + optimizer.bin; the
    order of optimizer.bin's parameters from its param groups' names when the optimizer was
    built from named_parameters(), else from --param-names). A torchtitan checkpoint of a model
    with fused QKV (llama3's) needs --head-dim: its optimizer holds the fused wqkv, its model
    entries the split wq/wk/wv, fused back as the module holds them.

    Read without a process group: `.metadata` through a restricted unpickler, tensors straight
    from the `.distcp` byte ranges. Without optimizer state every floating tensor is a
    parameter unless --buffers names it. SRC and OUT may be local or s3://.
    """)


def _read_dcp(src: str, buffers: str | None, param_names: list[str] | None = None,
              head_dim: int | None = None) -> Imported:
    import torch

    folder = src.rstrip("/") or "/"
    pattern = _buffer_pattern(buffers)
    sources, notes, beside = _sources(folder, param_names)
    if param_names is not None and sources[0].kind != AcceleratePlainSource.kind:
        raise ZeroshardError(f"--param-names applies only to an Accelerate save_state without FSDP or DeepSpeed "
                             f"(model.safetensors + optimizer.bin), and {folder} is not one")
    owner: dict[str, _Source | FlatSource] = {}
    paths: dict[str, tuple] = {}
    for source in sources:
        for key in source.keys():
            if key in owner:
                raise CheckpointError(folder, f"{key}: in both {owner[key].folder} and {source.folder}")
            owner[key], paths[key] = source, source.path(key)
    tensors = {k: dims for k, dims in ((k, s.dims(k)) for k, s in owner.items()) if dims is not None}
    fused = torchtitan.fused_qkv(folder, paths, tensors, head_dim)
    layout: Layout = classify(folder, paths, tensors, frozenset(fused))

    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    nested: dict[int, dict[str, Any]] = {}
    flat: dict[str, dict[str, Any]] = {}
    extras: dict[str, Any] = {}
    for key, slot in layout.slots.items():
        value = owner[key].read(key)
        if slot.kind == "model":
            model[slot.fqn] = value
        elif slot.kind == "state":
            state.setdefault(slot.fqn, {})[slot.key] = value
        elif slot.kind == "group" and slot.group is not None:
            nested.setdefault(slot.group, {})[slot.key] = value
        elif slot.kind == "group":
            flat.setdefault(slot.fqn, {})[slot.key] = value
        else:
            extras[slot.key] = value

    order = list(model)
    if fused:  # See [Note: torchtitan fused QKV]
        model = torchtitan.fuse(folder, model, fused, head_dim or 0)
        # the optimizer's order (its sharded state comes first in DCP's metadata; the split
        # weights, saved by one rank, come last): the order of the module's parameters
        order = list(dict.fromkeys([s.fqn for k, s in layout.slots.items() if s.kind == "state" and tensors.get(k)]
                                   + list(model)))
        notes.append(f"torchtitan's fused attention: {len(fused)} wqkv parameter(s) fused from the model entries' "
                     f"wq/wk/wv with head_dim {head_dim}, as the module holds them (the names its optimizer state has)")
    groups = _groups(folder, layout, nested, flat, order, notes)
    in_groups = [n for g in groups for n in g["params"]]
    absent = [n for n in list(dict.fromkeys(in_groups)) + [n for n in state if n not in in_groups]
              if n not in model]
    if absent:
        raise CheckpointError(folder, f"optimizer names parameters absent from the model: {', '.join(absent)}")
    if in_groups and any(n not in in_groups for n in state):
        raise CheckpointError(folder, "optimizer state for parameters in no param group: "
                                      + ", ".join(n for n in state if n not in in_groups))
    forced = {n for n in model if pattern is not None and pattern.fullmatch(n)}
    if pattern is not None and not forced:
        raise CheckpointError(folder, f"--buffers {buffers!r} matches no model tensor's full name")
    if layout.optimizer_prefix:
        names = in_groups or [n for n in model if n in state]
        clash = [n for n in names if n in forced]
        if clash:
            raise CheckpointError(folder, f"--buffers matches parameters the optimizer holds: {', '.join(clash)}")
    else:
        names = [n for n in model if model[n].is_floating_point() and n not in forced]

    prefixes: dict[str, Any] = {}
    kind = sources[0].kind
    imp = Imported(source=f"{kind}:{files.absolute(folder)}", params={}, zero_stage=3,
                   world_size=max(s.world_size for s in sources))
    for name in names:
        if not layout.optimizer_prefix and _tie_of(name, model[name].float(), imp.params, prefixes) is not None:
            continue  # a tied copy of a parameter already taken: an alias, below
        imp.params[name] = model[name].float()
        per_elem = {k: v for k, v in state.get(name, {}).items()
                    if (torch.is_tensor(v) or isinstance(v, LazyTensor)) and v.dim() >= 1}
        wrong = [k for k, v in per_elem.items() if v.numel() != model[name].numel()]
        if wrong:
            raise CheckpointError(folder, f"{name}: optimizer state {', '.join(wrong)} does not have the "
                                          f"parameter's {model[name].numel()} elements")
        if layout.optimizer_prefix:
            imp.optimizer_state[name] = {k: v.reshape(-1) for k, v in per_elem.items()}
            imp.scalar_state[name] = {k: scalar_json(v, f"optimizer state {k!r} of {name}")
                                      for k, v in state.get(name, {}).items() if k not in per_elem}
    left_as_buffers = []
    for name, value in model.items():
        if name in imp.params:
            continue
        twin = None if name in forced else _tie_of(name, value.float() if value.is_floating_point() else value,
                                                   imp.params, prefixes)
        if twin is not None and name not in state:
            imp.aliases[name] = twin  # a tied weight: saved twice by the state dict, one parameter
        else:
            imp.buffers[name] = value
            if value.is_floating_point() and name not in forced:
                left_as_buffers.append(name)
    imp.param_groups = groups
    imp.optimizer_class = optimizer_class_of(groups, notes=imp.notes) if layout.optimizer_prefix else None
    steps = [v["step"]["value"] for v in imp.scalar_state.values() if "step" in v]
    _carry_extras(imp, extras, notes)
    trained = imp.client_state.get("train_state", {}).get("step") if isinstance(imp.client_state, dict) else None
    imp.global_steps = imp.micro_steps = int(steps[0]) if steps else int(trained) if isinstance(trained, int) else 0

    label = {"accelerate": "Accelerate full state dict", "trainer": "Hugging Face Trainer (no DeepSpeed or FSDP)",
             "accelerate_plain": "Accelerate save_state (no FSDP or DeepSpeed)"}
    notes.insert(0, f"{label.get(kind, 'DCP')} layout: {layout.name}")
    if not layout.optimizer_prefix:
        notes.append(f"no optimizer state in the source: {len(imp.params)} floating tensor(s) imported as "
                     f"parameters, {len(imp.buffers)} as buffers ({', '.join(imp.buffers) or 'none'}); the engine "
                     "loads each into the model's tensor of its name, buffer or parameter (--buffers REGEX records "
                     "buffers as such); the engine's optimizer starts fresh")
    elif left_as_buffers:
        notes.append(f"floating tensors the optimizer does not hold, imported as buffers: {', '.join(left_as_buffers)} "
                     "(the engine loads any that its model has as a frozen parameter into that parameter)")
    if imp.aliases:
        notes.append("tied weights recognised by equal values: " +
                     ", ".join(f"{a} -> {t}" for a, t in imp.aliases.items()))
    imp.notes.extend(notes)
    carry_beside(imp, folder, beside, "the Trainer's checkpoint" if kind == "trainer" else "Accelerate save_state")
    return imp


def _carry_extras(imp: Imported, extras: dict[str, Any], notes: list[str]) -> None:
    """torchtitan's lr_scheduler / dataloader / train_state and other non-tensor entries into
    client state, nested back by their dotted paths, when they are JSON data; the rest named."""
    if not extras:
        return
    client: dict[str, Any] = {}
    dropped = []
    for key, value in extras.items():
        try:
            value = to_json_value(value, key)
        except TypeError:
            dropped.append(f"{key} ({type(value).__name__})")
            continue
        *parents, last = key.split(".")
        node = client
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                dropped.append(key)
                break
        else:
            node[last] = value
    scheduler = client.get(SCHEDULER_KEY)
    if isinstance(scheduler, dict) and {"last_epoch", "base_lrs"} <= scheduler.keys():
        # a torch scheduler's own state_dict() (dcp.save({..., "lr_scheduler": sched.state_dict()})):
        # what load_checkpoint(lr_scheduler=...) restores. torchtitan's ({"last_epoch"} alone) is
        # its container's, which no torch scheduler loads: left in client_state.
        imp.stateful[SCHEDULER_KEY] = client.pop(SCHEDULER_KEY)
        notes.append(f"LR scheduler state carried: {SCHEDULER_KEY} (restore it with load_checkpoint(..., "
                     "lr_scheduler=...) or a Checkpointer's stateful objects)")
    imp.client_state = client or None
    if client:
        notes.append(f"carried into client_state: {', '.join(sorted(client))}")
    loader = [d for d in dropped if d.startswith("dataloader.dp_rank_")]
    if loader:  # torchtitan's ParallelAwareDataloader: each data-parallel rank's position, pickled
        notes.append(f"not imported: torchtitan's dataloader state, {', '.join(loader)} (each data-parallel "
                     "rank's position as pickled bytes, which zeroshard never unpickles): position your data from "
                     "client_state['train_state']['step']")
    dropped = [d for d in dropped if d not in loader]
    if dropped:
        notes.append(f"not imported (not JSON data): {', '.join(dropped)}")
