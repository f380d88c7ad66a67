"""deepspeed.zero: Init and GatheredParameters.

Init(enabled=True, ...) is zeroshard.zero_init(): parameters built inside it are created on the
meta device, and initialize() materializes the model module by module (at stage 3 never whole
on any rank), initializing each module with its reset_parameters(). DeepSpeed's other arguments
(remote_device, config_dict_or_path, dtype, ...) are accepted and ignored. A module whose
parameters are set in __init__ beyond reset_parameters() is refused at initialize() with a
one-line error: build it outside Init (docs/DEEPSPEED.md).

GatheredParameters(params, modifier_rank=None): a collective, every rank enters it. At stage 3
each parameter gets its full value (gathered from the fp32 master shards) for the duration of
the block, in a tensor of its own as DeepSpeed's (`v.data.cpu()` kept by a script, a no-op on
the CPU, stays valid after the block); at stages 0-2 parameters are already whole. On exit with modifier_rank set, that
rank's values are broadcast and written into every rank's fp32 master shard (through the
engine's load_shards), so in-place initialisation inside the block takes effect.

At stage 3 each parameter carries DeepSpeed's attributes `ds_id`, `ds_numel`, `ds_shape` and
`ds_status` (ZeroParamStatus: AVAILABLE inside GatheredParameters, else NOT_AVAILABLE, also
during forward, where DeepSpeed's would say AVAILABLE). Scripts pick what to gather by them:
DeepSpeed-Chat's `save_zero_three_model` gathers exactly the parameters with a `ds_id` whose
status is NOT_AVAILABLE, and without the attributes would save unreleased storage.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from zeroshard.errors import InvalidArgumentError

_ENGINE_ATTR = "_zeroshard_engine"


def register_engine(engine: Any) -> None:
    """Remember which engine holds each parameter (called by zeroshard.deepspeed.initialize)."""
    ref = weakref.ref(engine)
    for ds_id, p in enumerate(engine.module.parameters()):
        setattr(p, _ENGINE_ATTR, ref)
        if engine.stage == 3:  # DeepSpeed's tags of a partitioned parameter (see the module docstring)
            p.ds_id, p.ds_numel, p.ds_shape = ds_id, p.numel(), p.shape
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


class Init:
    """DeepSpeed's zero.Init, as zeroshard.zero_init (parameters on meta until initialize)."""

    def __init__(self, module: Any = None, *args: Any, enabled: bool = True, **kwargs: Any) -> None:
        from zeroshard.engine.meta_init import zero_init

        self.enabled = enabled
        self._context = zero_init(enabled=enabled)

    def __enter__(self) -> "Init":
        self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)


class GatheredParameters:
    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)] if enabled else []
        self.modifier_rank = modifier_rank
        refs = {getattr(p, _ENGINE_ATTR, None) for p in self.params} - {None}
        if len(refs) > 1:
            raise InvalidArgumentError("GatheredParameters: the parameters belong to different engines")
        self.engine = next(iter(refs))() if refs else None
        self._released: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, its released data)

    def _names(self) -> list[str]:
        name_of = {id(p): n for n, p in self.engine.module.named_parameters()}
        return [name_of[id(p)] for p in self.params]

    def __enter__(self) -> "GatheredParameters":
        if self.engine is None or self.engine.stage != 3:
            return self
        shards = dict(self.engine.named_shards())
        world = self.engine.world_size
        with torch.no_grad():
            for p, name in zip(self.params, self._names()):
                info = shards[name]
                full = torch.empty(world * info.chunk, dtype=torch.float32, device=info.master.device)
                dist.all_gather_into_tensor(full, info.master.detach().contiguous())
                if p.data.untyped_storage().size() == 0:  # released by the engine: a full tensor for the block
                    self._released.append((p, p.data))  # (as DeepSpeed, what a script keeps of it outlives the block)
                    p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                p.data.copy_(full[: p.numel()].view(p.shape).to(p.dtype))
                p.ds_status = ZeroParamStatus.AVAILABLE
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.engine is not None and self.modifier_rank is not None and exc[0] is None:
                shards = dict(self.engine.named_shards())
                states = {}
                with torch.no_grad():
                    for p, name in zip(self.params, self._names()):
                        dist.broadcast(p.data, src=self.modifier_rank)
                        info = shards[name]
                        states[name] = {"fragment": p.data.reshape(-1)[info.start:info.end].float()}
                self.engine.load_shards(states, strict=False)
        finally:
            for p, released in self._released:  # back to the engine's released tensor (its storage)
                p.data = released
            self._released = []
            if self.engine is not None and self.engine.stage == 3:
                for p in self.params:
                    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
