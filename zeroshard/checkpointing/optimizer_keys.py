"""Does the saved optimizer state fit the optimizer it is loaded into?

A checkpoint's per-element optimizer state is loaded as it was saved, under its names
(`exp_avg`, `momentum_buffer`, ...). An optimizer that keeps other state (an SGD checkpoint
resumed with AdamW, Adam's with AdamW(amsgrad=True)) finds its own missing and fails at its
first step with a KeyError from inside torch, after the load said nothing. Which names an
optimizer keeps is known only once it has stepped: a throwaway copy of it steps once on a
two-element tensor to tell.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.errors import CheckpointError


def per_element_keys(optimizer: torch.optim.Optimizer, device: torch.device) -> frozenset[str] | None:
    """The names of the per-element state `optimizer`'s class keeps with its first group's
    options; None when that cannot be told (an optimizer that cannot be built that way)."""
    options = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} if optimizer.param_groups else {}
    probe = torch.zeros(2, device=device, requires_grad=True)
    try:
        accepted = inspect.signature(type(optimizer)).parameters  # a group can hold more (AdamW's decoupled flag)
        if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
            options = {k: v for k, v in options.items() if k in accepted}
        copy = type(optimizer)([probe], **options)
        probe.grad = torch.full_like(probe, 1e-3)
        copy.step()
        state = copy.state.get(probe) or {}
    except Exception:  # a custom optimizer with other arguments: nothing to compare with
        return None
    return frozenset(k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1 and v.numel() == 2)


def check_saved_keys(optimizer: torch.optim.Optimizer, device: torch.device, saved: Iterable[str],
                     saved_class: str, where: str, warn: bool) -> None:
    """Refuse state that lacks what `optimizer` keeps; warn (on `warn`) about state it drops."""
    saved = frozenset(saved)
    live = per_element_keys(optimizer, device) if saved else None
    if live is None:
        return
    ours = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    theirs = f"the saved optimizer state ({saved_class or 'optimizer unknown'}: {', '.join(sorted(saved))})"
    missing, unused = sorted(live - saved), sorted(saved - live)
    if missing:
        raise CheckpointError(where, f"{theirs} has no {', '.join(missing)}, which this {ours} keeps: its first "
                                     "step would fail. Resume with the optimizer (and options) the checkpoint was "
                                     "saved with, or load with load_optimizer_states=False to start the optimizer "
                                     "fresh")
    if unused and warn:
        warnings.warn(f"{where}: {theirs}: this {ours} does not use {', '.join(unused)}: it stays as loaded and no "
                      "step updates it", stacklevel=4)


def saved_keys(tensors: Iterable[Any]) -> set[str]:
    """The per-element state names a manifest's optimizer tensors hold."""
    return {t.state for t in tensors if t.role == "optimizer"}
