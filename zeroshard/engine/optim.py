"""Taking over the user's optimizer: the same object (or a factory's), over the fp32 shards.

Partitioning optimizer state by flat element ranges is only correct for elementwise optimizers
(Adam, AdamW, SGD, Adagrad, RMSprop, ...): each element's update must depend on that element
alone. Optimizers that look at whole tensors (norms, factored moments, orthogonalisation) are
refused by class name.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from zeroshard.engine.layout import ParamShard
from zeroshard.errors import ArgumentTypeError, InvalidArgumentError

# Lower-case class-name fragments of optimizers whose update needs the whole tensor.
WHOLE_TENSOR_OPTIMIZERS = ("lbfgs", "adafactor", "muon", "shampoo", "soap", "lamb", "lars",
                           "novograd", "sparseadam", "galore", "adammini")


def check_elementwise(cls: type) -> None:
    """Raise TypeError for optimizers whose update is not elementwise."""
    names = [k.__name__.lower() for k in cls.__mro__ if k not in (object, torch.optim.Optimizer)]
    for fragment in WHOLE_TENSOR_OPTIMIZERS:
        if any(fragment in n for n in names):
            raise ArgumentTypeError(
                f"{cls.__name__} updates whole tensors (norms/factored or matrix state); ZeRO "
                "partitions each tensor by flat element ranges, so only elementwise optimizers "
                "(Adam, AdamW, SGD, Adagrad, RMSprop, ...) are supported")


def check_user_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """The optimizer must be fresh, elementwise, and built on this module's parameters."""
    check_elementwise(type(optimizer))
    if any(len(s) for s in optimizer.state.values()):
        raise InvalidArgumentError("the optimizer already has state (was it stepped?); pass a fresh optimizer "
                         "or a factory `params -> optimizer` to zeroshard.initialize")
    known = {id(p) for p in module.parameters()}
    for i, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                raise InvalidArgumentError(f"optimizer param_groups[{i}] holds a tensor of shape {tuple(p.shape)} "
                                 "that is not a parameter of the model")
    in_groups = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in in_groups:
            raise InvalidArgumentError(f"parameter {name!r} requires grad but is in no optimizer param group; "
                             "add it or set requires_grad=False")


def build_optimizer(optimizer: Any, shards: Sequence[ParamShard]) -> torch.optim.Optimizer:
    """The real optimizer, over the masters of the trainable shards.

    [Note: the user's optimizer object] A torch optimizer passed in is kept and re-pointed at the
    masters (its param groups' "params"), as DeepSpeed re-points the client optimizer at its fp32
    partitions: an LR scheduler built on it before initialize (the usual PyTorch order, and every
    Accelerate or Trainer schedule) drives the groups the engine steps. A rebuilt copy would leave
    such a scheduler changing an optimizer nothing steps, and the LR constant, silently."""
    trainable = [s for s in shards if s.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        master_of = {id(s.param): s.master for s in trainable}
        for group in optimizer.param_groups:
            group["params"] = [master_of[id(p)] for p in group["params"] if id(p) in master_of]
        built = optimizer
    elif callable(optimizer):
        built = optimizer([s.master for s in trainable])
        if not isinstance(built, torch.optim.Optimizer):
            raise ArgumentTypeError(f"the optimizer factory returned {type(built).__name__}, not a torch optimizer")
        check_elementwise(type(built))
        ours = {id(s.master) for s in trainable}
        if any(id(p) not in ours for g in built.param_groups for p in g["params"]):
            raise InvalidArgumentError("the optimizer factory must build the optimizer on the params it is given")
    else:
        raise ArgumentTypeError(f"optimizer must be a torch.optim.Optimizer or a factory, "
                                f"not {type(optimizer).__name__}")
    return built


def group_names(optimizer: torch.optim.Optimizer, shards: Sequence[ParamShard]) -> list[list[str]]:
    """Names of the parameters in each param group (for checkpoints)."""
    name_of = {id(s.master): s.name for s in shards}
    return [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
