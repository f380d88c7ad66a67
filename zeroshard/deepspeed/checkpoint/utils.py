"""deepspeed.checkpoint.utils.clone_tensors_for_torch_save, which Accelerate's
`get_state_dict` calls on the model's state dict at ZeRO stages 0-2."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """`item` with every tensor in it (nested in lists, tuples and dicts) detached and copied to
    `device`: the copy owns its storage, so saving it does not save a larger shared buffer."""
    if torch.is_tensor(item):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
