"""A foreign checkpoint in memory, in zeroshard's terms, ready for write.py.

Tensors are full (unsharded) CPU tensors; whoever fills this cut them out of the source's
own partitions. Scalars (Adam's `step`) are JSON entries like the engine's own
({"dtype": "F32", "value": 3.0}).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Imported:
    source: str
    params: dict[str, Any]  # name -> full fp32 tensor, in the model's parameter order
    buffers: dict[str, Any] = field(default_factory=dict)
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)  # param -> state -> full tensor
    scalar_state: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # param -> state -> json
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # hyperparameters + "params": [names]
    optimizer_class: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    client_state: Any = None
    global_steps: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    zero_stage: int = 0
    world_size: int = 1
    compute_dtype: str = "F32"
    loss_scale: dict[str, Any] = field(default_factory=lambda: {"scale": 1.0, "good_steps": 0, "hysteresis_left": 0})
    lr_scheduler: Any = None
    notes: list[str] = field(default_factory=list)  # what could not be carried over, for the user


def optimizer_class_of(groups: list[dict[str, Any]], declared: str = "") -> str:
    """The torch optimizer a foreign checkpoint's param groups (or config) say it used."""
    kind = declared.lower()
    if kind == "adamw" or (not kind and groups and groups[0].get("decoupled_weight_decay")):
        return "torch.optim.adamw.AdamW"
    if kind == "adam" or (not kind and groups and "betas" in groups[0]):
        return "torch.optim.adam.Adam"
    if kind == "sgd" or (not kind and groups and "momentum" in groups[0]):
        return "torch.optim.sgd.SGD"
    return declared or "unknown"
