"""deepspeed.ops.adam: FusedAdam and DeepSpeedCPUAdam, as the torch optimizers they compute.

DeepSpeed's are fused kernels (CUDA, or a C++ op for the CPU) of torch's Adam update: decoupled
weight decay (AdamW) unless adam_w_mode/adamw_mode is False, then L2 decay (Adam). Here they
return torch's AdamW or Adam with the same hyperparameters, which the engine shards like any
elementwise optimizer, and which a checkpoint names so that any resume can build it. Scripts
pick between them (DeepSpeed-Chat: DeepSpeedCPUAdam when offloading, else FusedAdam); the
engine's config decides where optimizer state lives (`offload_optimizer`), not the class.
Refused, as torch's Adam cannot follow: bias_correction=False; amsgrad (DeepSpeed refuses it too).
They are functions named as DeepSpeed's classes: scripts call them, and get a torch optimizer.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zeroshard.deepspeed.optimizers import build_optimizer
from zeroshard.errors import UnsupportedFeatureError


def _adam(name: str, params: Iterable[Any], lr: float, bias_correction: bool, betas: Any, eps: float,
          weight_decay: float, amsgrad: bool, decoupled: bool) -> torch.optim.Optimizer:
    if amsgrad:
        raise UnsupportedFeatureError(f"{name}(amsgrad=True): not supported, as in DeepSpeed")
    if bias_correction is not True:
        raise UnsupportedFeatureError(f"{name}(bias_correction=False): not supported (torch's Adam always corrects)")
    options = {"lr": lr, "betas": list(betas), "eps": eps, "weight_decay": weight_decay}
    return build_optimizer({"type": "AdamW" if decoupled else "Adam", "params": {**options,
                                                                                 "adam_w_mode": decoupled}}, params)


def FusedAdam(params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
              betas: Any = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0,
              amsgrad: bool = False, set_grad_none: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's FusedAdam: torch's AdamW (Adam when adam_w_mode=False), DeepSpeed's defaults."""
    return _adam("FusedAdam", params, lr, bias_correction, betas, eps, weight_decay, amsgrad, bool(adam_w_mode))


def DeepSpeedCPUAdam(model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                     betas: Any = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                     adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> torch.optim.Optimizer:
    """DeepSpeed's DeepSpeedCPUAdam: torch's AdamW (Adam when adamw_mode=False), DeepSpeed's
    defaults. Its state is fp32, as the engine keeps any optimizer's."""
    return _adam("DeepSpeedCPUAdam", model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                 bool(adamw_mode))
