"""Accelerate's `save_state` without FSDP or DeepSpeed (DDP, or one process), presented as
dcp_import reads a DCP folder, as trainer_ddp.py presents the Trainer's equivalent.

The folder: `model.safetensors` (the model's state dict, tied copies left out), `optimizer.bin`
(torch's optimizer.state_dict(), pickled), `scheduler.bin`, `random_states_{r}.pkl` (one per
process), `custom_checkpoint_{i}.pkl`, and `sampler.bin`/`dl_state_dict.bin`/`scaler.pt` when the
run had them (beside.py carries or names those).

[Note: the optimizer's parameter order] optimizer.bin keys its state by parameter *index*: the
order in which the script handed the optimizer its parameters, group after group. No file
records it, except torch itself when the optimizer was built from `named_parameters()` (torch
2.6+ then saves each group's `param_names`), and the weights file cannot: safetensors sorts its
tensors by dtype and name, and parameters of one shape (q/k/v projections, norms and biases)
differ only in that order. So the names come from the groups' `param_names`, or from the user
(`--param-names FILE`: one name a line, in the optimizer's order, e.g. from
`model.named_parameters()` for `AdamW(model.parameters())`), else the import is refused; either
way every name must be a tensor of the weights file and every state its parameter's shape.
"""

from __future__ import annotations

import re

from zeroshard.errors import CheckpointError
from zeroshard.format.full_model import HF_SINGLE_NAME as MODEL
from zeroshard.interop import files, torch_zip
from zeroshard.interop.rng_states import rng_files
from zeroshard.interop.torch_pickle import MAX_NESTING, nesting_depth
from zeroshard.interop.trainer_ddp import TrainerSource, match_indices, weights_only_hint

OPTIMIZER = "optimizer.bin"
OWN = (MODEL, OPTIMIZER)
NAMES_OPTION = "--param-names FILE"


class AcceleratePlainSource(TrainerSource):
    """The model and optimizer of a plain Accelerate save_state folder, by name (see the notes)."""

    kind = "accelerate_plain"

    def __init__(self, folder: str, names: list[str], param_names: list[str] | None) -> None:
        super(TrainerSource, self).__init__(folder)  # FlatSource's: the Trainer's own reads config.json
        extra = sorted(n for n in names if re.fullmatch(r"model_\d+\.safetensors|optimizer_\d+\.bin", n))
        if extra:
            raise CheckpointError(folder, f"an Accelerate save_state of several models or optimizers "
                                          f"({', '.join(extra)}): only one of each is supported")
        self.world_size = len(rng_files(names)) or 1  # one random_states_{r}.pkl per process
        weights = self._weights()
        path = files.join(folder, OPTIMIZER)
        saved = torch_zip.load_lazy(path, folder)
        if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
                or not isinstance(saved.get("param_groups"), list) or nesting_depth(saved) > MAX_NESTING \
                or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved["param_groups"]):
            raise CheckpointError(path, "not torch's optimizer state_dict (state, param_groups with params)")
        order, self.named_by = _order(path, saved, param_names, folder)
        by_index = match_indices(path, saved, order, weights, folder, other="another optimizer",
                          wrong_order=f"the names are not in the optimizer's order ({self.named_by})")
        self._fill(path, saved, weights, by_index)


def _order(path: str, saved: dict, param_names: list[str] | None, folder: str) -> tuple[tuple[list[str], ...], str]:
    """Each group's parameter names in index order, and where they came from (see the notes)."""
    groups = saved["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    recorded = [g.get("param_names") for g in groups]
    if all(isinstance(r, list) and all(isinstance(n, str) for n in r) for r in recorded):
        order = tuple(list(r) for r in recorded)
        if [len(r) for r in order] != sizes:
            raise CheckpointError(path, f"param groups name {[len(r) for r in order]} parameters but hold {sizes}")
        named_by = "the param groups' param_names"
        if param_names is not None and [n for r in order for n in r] != param_names:
            raise CheckpointError(path, f"its param groups name their parameters, and {NAMES_OPTION} gives other "
                                        "names or another order: leave the option out")
    elif param_names is None:
        raise CheckpointError(folder, f"an Accelerate save_state without FSDP or DeepSpeed, whose {OPTIMIZER} keys its "
                                      f"state by parameter index in the order the script gave the optimizer its "
                                      f"parameters, which it does not record (torch does when the optimizer is "
                                      f"built from named_parameters()): pass {NAMES_OPTION}, the names in that "
                                      f"order one a line (for AdamW(model.parameters()): those of "
                                      f"model.named_parameters()); {weights_only_hint(folder)}")
    else:
        if len(param_names) != sum(sizes):
            raise CheckpointError(path, f"holds {sum(sizes)} parameters (param groups of {sizes}), and "
                                        f"{NAMES_OPTION} names {len(param_names)}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        order = tuple(param_names[s:s + n] for s, n in zip(starts, sizes))
        named_by = NAMES_OPTION
    flat = [n for r in order for n in r]
    twice = sorted({n for n in flat if flat.count(n) > 1})
    if twice:
        raise CheckpointError(path, f"{named_by} name a parameter twice: {', '.join(twice)}")
    return order, named_by
