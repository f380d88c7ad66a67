"""Parameter residency, one object per policy, chosen once at initialize (engine.py delegates).

  Replicated    stage 0: full module parameters on every rank; after a step the updated masters
                are copied in (in fp32, or without an optimizer, the master *is* the parameter:
                nothing to copy).
  Regathered    stages 1-2: full module parameters; after a step every rank's updated chunks
                are all-gathered back, asynchronously (param_gather.py).
  Partitioned   stage 3: the parameters exist only as shards and each unit is gathered around
                its forward and backward (stage3.py); offload_param picks where the partitions
                the gathers read live (param_offload.py).
  Hierarchical  stage 3 with ZeRO++'s hpZ secondary partition (hpz.py).

The engine calls the same hooks on all of them: forward(run), begin/end_backward, grad_done,
after_step, wait. `scheduler` (stage 3) and `refresh` (stages 1-2) are exposed for diagnostics.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from zeroshard.engine.hpz import HpzStage3
from zeroshard.engine.layout import ParamShard
from zeroshard.engine.param_gather import ParamRefresh
from zeroshard.engine.param_offload import ResidentTier, choose_tier
from zeroshard.engine.stage3 import Stage3
from zeroshard.errors import EngineUsageError

_UNGATHERED = ("a stage-3 parameter was used while not gathered: every parameter must be used inside "
               "the forward of a module that holds it (its unit). Use it through that module, or make "
               "an enclosing module one unit (zero_optimization.stage3_unit_classes)")


class ParamResidency:
    """Base (full parameters on every rank). `partitioned`: no full copy outside a unit's use."""

    partitioned = False
    scheduler: Stage3 | None = None
    refresh: ParamRefresh | None = None

    def __init__(self, module: nn.Module, shards: list[ParamShard], dtype: torch.dtype, world: int,
                 group: Any, config: Any, device: torch.device) -> None:
        self.shards, self.dtype = shards, dtype
        with torch.no_grad():  # module params to the compute dtype (the masters hold fp32)
            for s in shards:
                s.param.data = s.param.data.to(dtype).contiguous()

    def tier(self, spec: Mapping[str, Any] | None, rank: int) -> ResidentTier:
        return choose_tier(spec, None, self.dtype, torch.device("cpu"), rank)

    def forward(self, run: Callable[[], Any]) -> Any:
        try:
            return run()
        finally:
            self.wait()  # parameters this forward did not touch

    def begin_backward(self) -> None:
        pass

    def backward_failed(self, error: BaseException) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def grad_done(self, shard: ParamShard) -> None:
        pass

    def after_step(self, trainable: list[ParamShard]) -> None:
        """The masters were just updated: bring the module parameters up to date."""

    def wait(self) -> None:
        """Finish parameter updates still in flight."""

    def inflight_bytes(self) -> int:
        return 0


class Replicated(ParamResidency):
    def __init__(self, module: nn.Module, shards: list[ParamShard], dtype: torch.dtype, world: int,
                 group: Any, config: Any, device: torch.device) -> None:
        super().__init__(module, shards, dtype, world, group, config, device)
        for s in shards:
            if s.master.dtype == dtype:  # fp32 DDP, or an inference engine: no separate master copy
                s.master = s.param.data.view(-1)

    def after_step(self, trainable: list[ParamShard]) -> None:
        with torch.no_grad():
            for s in trainable:
                if s.master.data_ptr() != s.param.data.data_ptr():
                    s.param.data.copy_(s.master.view(s.shape))


class Regathered(ParamResidency):
    def __init__(self, module: nn.Module, shards: list[ParamShard], dtype: torch.dtype, world: int,
                 group: Any, config: Any, device: torch.device) -> None:
        super().__init__(module, shards, dtype, world, group, config, device)
        trainable = [s for s in shards if s.requires_grad]
        self.refresh = ParamRefresh(module, trainable, dtype, world, group,
                                    int(config.zero_optimization.allgather_bucket_size), device)

    def after_step(self, trainable: list[ParamShard]) -> None:
        self.refresh.start()  # completed by the next forward's module pre-hooks (param_gather.py)

    def wait(self) -> None:
        self.refresh.finish()

    def inflight_bytes(self) -> int:
        return self.refresh.inflight_bytes()


class Partitioned(ParamResidency):
    partitioned = True

    def __init__(self, module: nn.Module, shards: list[ParamShard], dtype: torch.dtype, world: int,
                 group: Any, config: Any, device: torch.device) -> None:
        self.shards, self.dtype, self.device = shards, dtype, device
        self.scheduler = self._scheduler(module, shards, dtype, world, group, config.zero_optimization, device)

    def _scheduler(self, module: nn.Module, shards: list[ParamShard], dtype: torch.dtype, world: int,
                   group: Any, z: Any, device: torch.device) -> Stage3:
        return Stage3(module, shards, dtype, world, group, z.stage3_prefetch, z.stage3_unit_classes,
                      z.unit_predicate, device)

    def tier(self, spec: Mapping[str, Any] | None, rank: int) -> ResidentTier:
        return choose_tier(spec, self.scheduler, self.dtype, self.device, rank)

    def forward(self, run: Callable[[], Any]) -> Any:
        self.scheduler.begin_forward()
        try:
            return run()
        except RuntimeError as e:
            self.scheduler.release_all()
            if "storage of size 0" in str(e):
                raise EngineUsageError(_UNGATHERED) from e
            raise
        except BaseException:
            self.scheduler.release_all()
            raise
        finally:
            self.scheduler.end_forward()

    def begin_backward(self) -> None:
        self.scheduler.begin_backward()

    def backward_failed(self, error: BaseException) -> None:
        self.scheduler.release_all()
        if isinstance(error, RuntimeError) and "storage of size 0" in str(error):
            raise EngineUsageError(_UNGATHERED + " (in backward: was a unit's output modified "
                                   "in place? use out-of-place ops on unit outputs)") from error

    def end_backward(self) -> None:
        self.scheduler.end_backward()

    def grad_done(self, shard: ParamShard) -> None:
        self.scheduler.grad_done(shard)

    def inflight_bytes(self) -> int:
        return self.scheduler.inflight_bytes()


class Hierarchical(Partitioned):
    """Stage 3 with hpZ: the unit gathers run inside the node (hpz.py)."""

    def _scheduler(self, module: nn.Module, shards: list[ParamShard], dtype: torch.dtype, world: int,
                   group: Any, z: Any, device: torch.device) -> Stage3:
        return HpzStage3(module, shards, dtype, world, z.zero_hpz_partition_size, int(z.allgather_bucket_size),
                         z.stage3_prefetch, z.stage3_unit_classes, z.unit_predicate, device)

    def tier(self, spec: Mapping[str, Any] | None, rank: int) -> ResidentTier:
        return self.scheduler.tier  # the secondary partition (config.py refuses offload_param with it)


def param_residency_for(stage: int, hpz_size: int = 1, world: int = 1) -> type[ParamResidency]:
    if stage == 3 and 1 < hpz_size < world:
        return Hierarchical  # hpz_size == world is one node: plain stage 3
    return {0: Replicated, 3: Partitioned}.get(stage, Regathered)
