"""Which DCP layout a checkpoint has, decided from its keys' paths alone, and where each key goes.

DCP flattens the saved dict; `planner_data` keeps each flat key's path, e.g.
`("model", "fc.weight")` or `("optim", "state", "fc.weight", "exp_avg")`. The layouts real
tools write:

 - the model under `model` (FSDP2 with get_state_dict, Accelerate's `pytorch_model_fsdp_0`,
   eval exports) or at the top level, one-element paths (torchtitan's CheckpointManager,
   a plain `dcp.save(model.state_dict())`);
 - the optimizer, if any, under `optim` or `optimizer`, either nested
   (`state.<fqn>.<k>` and `param_groups.<i>.<k>`, get_state_dict's default and Accelerate)
   or flattened, one path element `state.<fqn>.<k>` / `param_groups.<fqn>.<k>`
   (get_state_dict(..., flatten_optimizer_state_dict=True), torchtitan's OptimizersContainer);
 - that flattened optimizer saved beside the model's keys with no prefix at all
   (`dcp.save({**model_sd, **get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)})`):
   `state.<fqn>.<k>` and `param_groups.<fqn>.<k>` where fqn is a model key; its moments are
   optimizer state, never weights;
 - torchtitan's `lr_scheduler`, `dataloader`, `train_state`, and other non-tensor (or 0-d
   tensor) entries beside the model, which become client state; its optimizer state of a fused
   parameter the model entries hold split (`assembled`, torchtitan.py).

Anything else is refused naming the keys not understood: nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroshard.errors import CheckpointError

OPTIMIZER_HEADS = ("optim", "optimizer")
TOP_LEVEL = "(top level)"  # Layout.optimizer_prefix of a flattened optimizer saved with no prefix
EXTRA_HEADS = ("lr_scheduler", "dataloader", "train_state")
_SHOWN = 6  # unrecognised keys named in the error before "+N more"


@dataclass(frozen=True)
class Slot:
    """Where one flat key goes: kind "model" (fqn), "state" (fqn, key: the state's name),
    "group" (group: an index when nested; fqn when flattened; key: the option), "extra"
    (key: the dotted path, kept as client state if it is JSON data)."""

    kind: str
    fqn: str = ""
    key: str = ""
    group: int | None = None


@dataclass
class Layout:
    model_prefix: str | None  # "model", or None for model keys at the top level
    optimizer_prefix: str | None
    flattened: bool  # the optimizer's state and groups are keyed by FQN in one path element
    slots: dict[str, Slot] = field(default_factory=dict)

    @property
    def name(self) -> str:
        model = f"'{self.model_prefix}.*'" if self.model_prefix else "top-level model keys"
        if not self.optimizer_prefix:
            return f"{model}, no optimizer"
        if self.optimizer_prefix == TOP_LEVEL:
            return f"{model}, flattened optimizer at the top level ('state.*', 'param_groups.*')"
        return f"{model}, {'flattened' if self.flattened else 'nested'} '{self.optimizer_prefix}.*'"


def _unrecognised(where: str, keys: list[str], why: str) -> CheckpointError:
    shown = ", ".join(keys[:_SHOWN]) + (f" (+{len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else "")
    return CheckpointError(where, f"{len(keys)} entr{'y' if len(keys) == 1 else 'ies'} not understood ({why}): "
                                  f"{shown}")


def _split_flat(rest: str, fqns: set[str]) -> tuple[str, str] | None:
    """`<fqn>.<k>` split where fqn is a model key and k has no dot (FQNs may contain dots; the
    model's keys make the split unambiguous)."""
    head, dot, last = rest.rpartition(".")
    return (head, last) if dot and head in fqns else None


def _top_level_optimizer(where: str, paths: dict[str, tuple], fqns: set[str]) -> dict[str, Slot]:
    """The keys of a flattened optimizer saved with no prefix: one-element paths
    `state.<fqn>.<k>` / `param_groups.<fqn>.<k>` where fqn is one of the model's `fqns` (the
    longest that fits: FQNs hold dots). Refused in one line: such state with no param_groups
    entries (a moment is never taken for a weight) and state nested deeper than one name."""
    found: dict[str, Slot] = {}
    for key, path in paths.items():
        if len(path) != 1 or not isinstance(path[0], str):
            continue
        section, _, rest = path[0].partition(".")
        if section not in ("state", "param_groups"):
            continue
        fqn = next((rest[:i] for i in range(len(rest) - 1, 0, -1) if rest[i] == "." and rest[:i] in fqns), None)
        if fqn is None:
            continue
        name = rest[len(fqn) + 1:]
        if "." in name:
            raise CheckpointError(where, f"{key}: optimizer state nested below its parameter (Shampoo's?) is not "
                                         "supported")
        found[key] = Slot("state" if section == "state" else "group", fqn=fqn, key=name)
    if found and not any(s.kind == "group" for s in found.values()):
        shown = ", ".join(list(found)[:_SHOWN])
        raise CheckpointError(where, f"entries named like a flattened optimizer's state ({shown}) but no "
                                     "param_groups.<fqn>.* entries: not imported (they are not weights)")
    return found


def classify(where: str, paths: dict[str, tuple], tensors: dict[str, int], assembled: frozenset[str] = frozenset()
             ) -> Layout:
    """The layout of a checkpoint whose flat keys have `paths`; `tensors`: the keys that are
    tensors, with their number of dimensions (the others are pickled objects); `assembled`:
    parameter names the optimizer may hold that are built from other model entries
    (See [Note: torchtitan fused QKV]). Raises CheckpointError listing what fits no layout."""
    heads = {p[0] for p in paths.values() if p}
    optimizers = [h for h in OPTIMIZER_HEADS if h in heads]
    if len(optimizers) > 1:
        raise CheckpointError(where, "both 'optim.*' and 'optimizer.*' entries: which optimizer is meant is unclear")
    opt = optimizers[0] if optimizers else None
    under_model = any(p[0] == "model" and len(p) == 2 for p in paths.values())
    layout = Layout("model" if under_model else None, opt, False)
    slots, bad = layout.slots, []
    for key, path in paths.items():
        if under_model and path[0] == "model":
            if len(path) == 2 and key in tensors:
                slots[key] = Slot("model", fqn=str(path[1]))
            else:
                bad.append(key)
        elif not under_model and len(path) == 1 and key in tensors and path[0] not in OPTIMIZER_HEADS + EXTRA_HEADS:
            slots[key] = Slot("model", fqn=str(path[0]))
    top = {} if opt else _top_level_optimizer(where, paths, {s.fqn for s in slots.values()} | assembled)
    slots.update(top)  # a moment saved beside the weights is optimizer state, not a weight
    if top:
        layout.optimizer_prefix = opt = TOP_LEVEL
    fqns = {s.fqn for s in slots.values() if s.kind == "model"} | assembled
    nested, flat = False, bool(top)
    for key, path in paths.items():
        if key in slots or key in bad:
            continue
        if path[0] == opt:
            slot = None
            if len(path) == 4 and path[1] == "state":
                slot, nested = Slot("state", fqn=str(path[2]), key=str(path[3])), True
            elif len(path) == 4 and path[1] == "param_groups" and str(path[2]).isdigit():
                slot, nested = Slot("group", key=str(path[3]), group=int(path[2])), True
            elif len(path) == 2 and isinstance(path[1], str):
                section, _, rest = path[1].partition(".")
                split = _split_flat(rest, fqns) if section in ("state", "param_groups") else None
                if split:
                    slot, flat = Slot("state" if section == "state" else "group", fqn=split[0], key=split[1]), True
            if slot is None:
                bad.append(key)
            else:
                slots[key] = slot
        elif path[0] in EXTRA_HEADS or not tensors.get(key):  # objects and 0-d tensors ("step")
            slots[key] = Slot("extra", key=".".join(map(str, path)))
        else:
            bad.append(key)
    if bad:
        raise _unrecognised(where, bad, "not model weights, optimizer state by FQN, or torchtitan's extras; "
                                        "nested optimizer states such as Shampoo's are not supported")
    if nested and flat:
        raise CheckpointError(where, f"'{opt}.*' mixes nested and flattened optimizer entries")
    if not any(s.kind == "model" for s in slots.values()):
        raise CheckpointError(where, "no model weights: expected 'model.<fqn>' entries or model keys at the top level")
    layout.flattened = flat
    return layout
