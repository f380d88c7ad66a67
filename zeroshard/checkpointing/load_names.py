"""Which saved tensor each of the model's parameters and buffers loads from, checked before a
byte is read.

Names match as in torch's `load_state_dict`: parameters and buffers alike, missing and
unexpected names refused under strict, shape mismatches always. The roles may differ where the
writer could not tell them apart, and only there:

- a frozen parameter (in no optimizer group, as fine-tuning leaves it) that an import of a DCP
  checkpoint saved as a buffer loads back as the parameter, if its dtype is floating;
- a buffer that `zeroshard shard` or a model-only import saved as a parameter (a full-model
  file does not say which tensors are buffers) loads back as the buffer, if no optimizer state
  was saved for it.

Any other difference of role is refused like a missing name: loading a trained parameter into a
buffer would drop its optimizer state.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Mapping

from zeroshard.engine.contract import EngineState
from zeroshard.errors import CheckpointError
from zeroshard.format.manifest import TensorEntry
from zeroshard.storage.safetensors_header import torch_dtype

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class LoadNames:
    params: list[str]   # the model's parameters to load, in the model's order
    buffers: list[str]  # the model's buffers to load


def match_names(target: EngineState, tensors: Mapping[str, TensorEntry], where: str, strict: bool,
                warn: bool = False) -> LoadNames:
    """The model tensors of `target` that load from the saved `tensors` (a manifest's entries);
    raises a CheckpointError naming every problem (see the module docstring). `warn`: this rank
    says in a warning what a strict=False load leaves out."""
    params = {i.name: i for i in target.params}
    buffers = {b.name: b for b in target.buffers}
    trained = {t.param for t in tensors.values() if t.role == "optimizer"}
    theirs: dict[str, tuple[int, ...]] = {}
    conflicts: dict[str, str] = {}
    for name, entry in tensors.items():
        if entry.role not in ("param", "buffer"):
            continue
        why = _role_conflict(entry, params[name].requires_grad if name in params else None,
                             name in buffers, name in trained)
        if why:
            conflicts[name] = why
        else:
            theirs[name] = tuple(entry.shape)
    names = check_names(model_shapes(target), theirs, where, strict, warn, conflicts)
    return LoadNames([n for n in names if n in params], [n for n in names if n in buffers])


def model_shapes(target: EngineState) -> dict[str, tuple[int, ...]]:
    """The shapes of the model's parameters and (persistent) buffers, by name."""
    return {i.name: tuple(i.shape) for i in target.params} | {b.name: tuple(b.tensor.shape) for b in target.buffers}


def _role_conflict(entry: TensorEntry, trainable: bool | None, model_buffer: bool, trained: bool) -> str:
    """Why a saved entry cannot load into the model tensor of its name ("" when it can, or when
    the model has no tensor of that name). `trainable`: None when the model's is no parameter."""
    if trainable is not None and entry.role == "buffer" \
            and (trainable or not torch_dtype(entry.dtype).is_floating_point):
        return f"a {entry.dtype} buffer in the checkpoint, a {'trainable ' if trainable else ''}parameter in the model"
    if model_buffer and entry.role == "param" and trained:
        return "a trained parameter in the checkpoint, with optimizer state; a buffer in the model"
    return ""


def check_names(ours: Shapes, theirs: Shapes, where: str, strict: bool, warn: bool = False,
                conflicts: Mapping[str, str] | None = None) -> list[str]:
    """The names of `ours` (the model's tensors) to load from `theirs` (the saved ones), name ->
    shape; raises listing missing, unexpected, mis-shaped names and `conflicts` (saved in another
    role: name -> why). With strict=False the names on one side only, and the conflicts, are skipped, said in
    one warning (`warn`: this rank says it), unless no name at all is shared: then nothing would
    load, which is never meant."""
    conflicts = conflicts or {}
    missing = sorted(set(ours) - set(theirs) - set(conflicts))
    conflicting = sorted(f"{n} ({why})" for n, why in conflicts.items())
    unexpected = sorted(set(theirs) - set(ours))
    mismatched = sorted(f"{n} (checkpoint {list(theirs[n])}, model {list(ours[n])})"
                        for n in set(ours) & set(theirs) if theirs[n] != ours[n])
    names = [n for n in ours if n in theirs]
    problems = []
    if mismatched:
        problems.append(f"shape mismatch: {', '.join(mismatched)}")
    if (strict or not names) and conflicts:
        problems.append(f"saved in another role: {few(conflicting)}")
    if (strict or not names) and missing:
        problems.append(f"missing from the checkpoint: {few(missing)}")
    if (strict or not names) and unexpected:
        problems.append(f"not in the model: {few(unexpected)}")
    if problems:
        prefix = _prefix_hint(missing, unexpected)
        if prefix:
            hint = f" ({prefix})"
        elif mismatched or not names:
            hint = ""
        else:
            hint = " (strict=False loads the others and leaves these as they are)"
        raise CheckpointError(where, "; ".join(problems) + hint)
    if warn and (missing or unexpected or conflicts):
        warnings.warn(f"{where}: strict=False: {len(missing)} model tensor(s) not in the checkpoint keep their "
                      f"values ({few(missing) or 'none'}); {len(unexpected)} checkpoint tensor(s) not in the "
                      f"model were not loaded ({few(unexpected) or 'none'})"
                      + (f"; {len(conflicts)} saved in another role were not loaded ({few(conflicting)})"
                         if conflicts else ""), stacklevel=4)
    return names


def few(names: list[str], shown: int = 8) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """When the two sides' names differ only by a leading prefix (torch.compile's `_orig_mod.`,
    DDP's `module.`), which one: the usual cause of a checkpoint that 'misses' every parameter."""
    for longer, shorter, side in ((missing, unexpected, "the model's"), (unexpected, missing, "the checkpoint's")):
        if not longer or not shorter:
            continue
        first = longer[0]
        prefix = next((first[:-len(n)] for n in shorter if first.endswith("." + n)), None)
        stripped = {n[len(prefix):] for n in longer} if prefix else set()
        # one side may hold a tied weight under both names (a full model) where the other counts it once
        if prefix and all(n.startswith(prefix) for n in longer) \
                and (set(shorter) <= stripped or stripped <= set(shorter)):
            fix = (f" (load_pretrained(..., strip_prefix={prefix!r}) reads a full model's as they are; `zeroshard "
                   f"shard FULL_MODEL OUT --world N --strip-prefix {prefix}` renames them)"
                   if side == "the checkpoint's" else "")
            return (f"every one of {side} tensor names starts with {prefix!r} and the other side's do not: "
                    f"a wrapper such as torch.compile or DDP around one model?{fix}")
    return ""
