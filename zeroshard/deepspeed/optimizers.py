"""The DeepSpeed config's "optimizer" section as a torch optimizer, with DeepSpeed's meaning.

DeepSpeed builds "Adam"/"AdamW" as FusedAdam (or torch's with "torch_adam"), whose defaults
differ from torch's: weight_decay 0 for both, and "Adam" means AdamW (decoupled decay) unless
"adam_w_mode": false. "AdamW" is always decoupled. Other names are looked up in torch.optim, as
DeepSpeed does; the engine refuses those that are not elementwise.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch

from zeroshard.errors import ConfigError

_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_IGNORED_ADAM_KEYS = ("torch_adam", "fp32_optimizer_states", "set_grad_none")
_REFUSED = {"onebitadam", "zerooneadam", "onebitlamb", "lamb", "lion", "muon", "muadam", "muadamw", "musgd"}


def build_optimizer(section: dict[str, Any], params: Iterable[Any]) -> torch.optim.Optimizer:
    kind = str(section.get("type", ""))
    options = dict(section.get("params") or {})
    if "max_grad_norm" in options:
        raise ConfigError("'max_grad_norm' is not an optimizer parameter: use the config's 'gradient_clipping'")
    lower = kind.lower()
    if lower in ("adam", "adamw"):
        adam_w_mode = options.pop("adam_w_mode", True)
        decoupled = lower == "adamw" or bool(adam_w_mode)
        if options.pop("bias_correction", True) is not True:
            raise ConfigError("optimizer.params.bias_correction=false is not supported (torch Adam always corrects)")
        ignored = [k for k in _IGNORED_ADAM_KEYS if options.pop(k, None) is not None]
        if ignored:
            warnings.warn(f"zeroshard ignores optimizer.params {ignored} (torch Adam/AdamW is used)", stacklevel=3)
        kwargs = {**_ADAM_DEFAULTS, **options}
        kwargs["betas"] = tuple(kwargs["betas"])
        return (torch.optim.AdamW if decoupled else torch.optim.Adam)(params, **kwargs)
    if lower in _REFUSED:
        raise ConfigError(f"optimizer type {kind!r} is not supported by zeroshard (elementwise torch optimizers only)")
    cls = getattr(torch.optim, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer type {kind!r} is neither Adam/AdamW nor a torch.optim class")
    return cls(params, **options)
