"""Deferred initialization: models built on the meta device, materialized one module at a time.

A model built under `torch.device("meta")` or `zeroshard.zero_init()` has parameters with a shape
but no storage. `initialize` then (1) swaps each meta parameter for a real one (at stage 3 with no
storage at all; at stages 0-2 full-size) and each meta buffer for an empty real one, and (2) runs
the initializers module by module, each on a temporary full-size CPU copy of that module's own
tensors, handing every finished parameter to a `sink` (stage 3: copy this rank's range into the
fp32 master, then drop the copy). Peak extra memory is one module's parameters.

Same result as eager init, at any world size: eager construction runs each module's initializer
when its `__init__` ends, so children before their parent (post-order), on the CPU generator.
We replay exactly that: post-order, on CPU, starting from rank 0's CPU RNG state (so every rank
computes the same values, as eager init followed by DDP's broadcast from rank 0 would give).
A tied parameter's second holder is initialized too, into a discarded scratch tensor: eager code
builds the second module (consuming the RNG) and ties afterwards.

Supported initializers: `module.reset_parameters()` (nn.Linear, Embedding, LayerNorm, Conv, ...),
or a user `init_fn(module)` called instead for every module that holds meta tensors directly.
Not replayed: custom init written in an `__init__` after construction (e.g.
`self.gain = nn.Parameter(torch.ones(d))`, or Hugging Face `post_init`), values of buffers
computed in `__init__` under `torch.device("meta")`; pass `init_fn` for those, or build under
`zero_init()`, which puts only parameters on meta and keeps buffers real.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.errors import InvalidArgumentError
from zeroshard.torch_version import require_supported_torch

InitFn = Callable[[nn.Module], None]


@contextlib.contextmanager
def zero_init(enabled: bool = True) -> Iterator[None]:
    """Build a model with its parameters on the meta device (buffers stay real).

        with zeroshard.zero_init():
            model = MyModel()
        engine = zeroshard.initialize(model, opt, config)   # materialized and sharded here

    The DeepSpeed spelling `deepspeed.zero.Init()` maps to this; enabled=False does nothing
    (as DeepSpeed's `enabled`).
    """
    require_supported_torch()
    if not enabled:
        yield
        return
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta._zeroshard_zero_init = True  # so a mismatch can say "built under zero_init()" (agreement.py)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def check_initializable(module: nn.Module, init_fn: InitFn | None) -> None:
    """Raise ValueError (before any collective) if some meta tensor would have no initializer."""
    if init_fn is not None:
        return
    for name, m in module.named_modules():
        direct = [n for n, t in list(m._parameters.items()) + list(m._buffers.items()) if t is not None and t.is_meta]
        if direct and not callable(getattr(m, "reset_parameters", None)):
            where = name or "the root module"
            raise InvalidArgumentError(f"{where} ({type(m).__name__}) holds meta tensors {direct} but has no "
                             "reset_parameters(); pass init_fn=... to zeroshard.initialize")


def _post_order(module: nn.Module) -> list[nn.Module]:
    seen: set[int] = set()
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(module)
    return out


class MetaInit:
    """The meta tensors of one model, replaced by real ones, and their pending initialization."""

    def __init__(self, module: nn.Module, device: torch.device, storage: bool) -> None:
        """Swap meta tensors for real ones on `device`; storage=False leaves parameters storage-less."""
        self.module = module
        self.replaced: dict[int, nn.Parameter] = {}  # id(meta param) -> its replacement
        self.pending: set[int] = set()  # ids of replacement params/buffers awaiting their values
        for m in _post_order(module):
            for name, p in list(m._parameters.items()):
                if p is None or not (p.is_meta or id(p) in self.replaced):
                    continue
                if id(p) not in self.replaced:
                    data = torch.empty(p.shape, dtype=p.dtype, device=device)  # untouched: not resident
                    if not storage:
                        data.untyped_storage().resize_(0)  # shape kept, no storage (as stage 3 frees)
                    new = nn.Parameter(data, requires_grad=p.requires_grad)
                    self.replaced[id(p)] = new
                    self.pending.add(id(new))
                m._parameters[name] = self.replaced[id(p)]
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
                    self.pending.add(id(m._buffers[name]))

    def remap_optimizer(self, optimizer: Any) -> None:
        """A user optimizer built on the meta parameters now points at their replacements."""
        if isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:
                group["params"] = [self.replaced.get(id(p), p) for p in group["params"]]

    def materialize(self, init_fn: InitFn | None, sink: Callable[[nn.Parameter, torch.Tensor], None],
                    device: torch.device = torch.device("cpu"), group: Any = None) -> None:
        """Initialize every pending tensor module by module (see the module docstring)."""
        local = torch.get_rng_state()
        start = local
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            wire = local.to(device)  # NCCL broadcasts device tensors only
            dist.broadcast(wire, src=0, group=group)
            start = wire.cpu()
        torch.set_rng_state(start)
        done: set[int] = set()
        try:
            with torch.no_grad():
                for m in _post_order(self.module):
                    self._init_module(m, init_fn, sink, done)
        finally:
            if not torch.equal(local, start):
                torch.set_rng_state(local)  # ranks seeded differently keep their own streams
        self.pending.clear()

    def _init_module(self, m: nn.Module, init_fn: InitFn | None,
                     sink: Callable[[nn.Parameter, torch.Tensor], None], done: set[int]) -> None:
        params = {n: p for n, p in m._parameters.items() if p is not None and id(p) in self.pending}
        buffers = {n: b for n, b in m._buffers.items() if b is not None and id(b) in self.pending}
        if not params and not buffers:
            return
        if init_fn is None and not callable(getattr(m, "reset_parameters", None)):
            names = sorted(list(params) + list(buffers))
            raise InvalidArgumentError(f"{type(m).__name__} holds meta tensors {names} but has no reset_parameters(); "
                             "pass init_fn=... to zeroshard.initialize to initialize them")
        temps = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                 for n, p in params.items()}
        temp_bufs = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in buffers.items()}
        m._parameters.update(temps)
        m._buffers.update(temp_bufs)
        try:
            init_fn(m) if init_fn is not None else m.reset_parameters()
        finally:
            m._parameters.update(params)
            m._buffers.update(buffers)
        for n, p in params.items():
            if id(p) not in done:  # a tied parameter's later holders initialized a scratch copy
                done.add(id(p))
                sink(p, temps[n].detach())
        for n, b in buffers.items():
            b.copy_(temp_bufs[n])
