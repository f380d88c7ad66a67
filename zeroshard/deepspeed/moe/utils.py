"""No-MoE pass-throughs for deepspeed.moe.utils (zeroshard has no expert parallelism)."""

from __future__ import annotations

from typing import Any


def is_moe_param(param: Any) -> bool:
    """Always False: no parameter is an expert parameter here."""
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = None) -> list:
    """The groups unchanged, as a list (what DeepSpeed returns when there are no MoE params)."""
    if isinstance(param_groups, dict):
        return [param_groups]
    if isinstance(param_groups, tuple):
        return list(param_groups)
    return list(param_groups)


def split_params_grads_into_shared_and_expert_params(group: Any) -> tuple[list, list]:
    params = [p for p in group if p.grad is not None]
    return params, []
