"""Stages 1-2: the updated parameters come back while the next forward already runs (as FSDP).

After an optimizer step every rank's updated master chunks must be all-gathered into the full
module parameters. Instead of one blocking pass, the trainable shards are cut into buckets in
registration order (coalesced: one all-gather per bucket), the first `depth` are launched at
once, and each module's forward pre-hook waits only for the buckets holding its own parameters,
launching the next ones as it goes; so the gathers of later layers overlap the compute of
earlier ones. Buckets follow the order in which the first forward used the parameters (a
module's pre-hook fires before its children run: a root-held parameter is needed first), as
rank 0 saw it (one broadcast, at the first step), so every rank launches the same buckets in
the same order whatever triggers it.
`finish()` completes whatever is left: the engine calls it when a forward ends (parameters no
forward touched), and before anything else reads or writes the module parameters.

A module's `state_dict()` taken while buckets are pending would hold the weights from before the
step, and nothing would say so (a rank-0 `torch.save(engine.module.state_dict())` at the end of
training): it is refused, naming `wait_params()`. Waiting there instead is not possible: the
buckets still to launch are collectives, and such calls are often made on one rank only.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.engine.collectives import Gather, broadcast, buckets, start_gather
from zeroshard.engine.layout import ParamShard
from zeroshard.errors import EngineUsageError


class ParamRefresh:
    """Asynchronous, bucketed parameter all-gathers with per-module waits."""

    def __init__(self, module: nn.Module, shards: Sequence[ParamShard], dtype: torch.dtype, world: int,
                 group: Any, bucket_elems: int, device: torch.device, depth: int = 2) -> None:
        self.dtype, self.world, self.group, self.device, self.depth = dtype, world, group, device, depth
        self.shards, self.bucket_elems = list(shards), bucket_elems
        self._build(list(range(len(self.shards))))
        self._seen: list[int] | None = []  # first-use order, recorded until the first start()
        self.inflight: dict[int, Gather] = {}
        self.next = self.done = len(self.buckets)  # nothing pending until start()
        position = {id(s.param): i for i, s in enumerate(self.shards)}
        self.handles = []
        for m in module.modules():
            mine = [position[id(p)] for p in m.parameters(recurse=False) if id(p) in position]
            if mine:
                self.handles.append(m.register_forward_pre_hook(partial(self._pre_forward, mine)))
                self.handles.append(m.register_state_dict_pre_hook(self._refuse_stale))

    def inflight_bytes(self) -> int:
        """Bytes of gather buffers launched and not yet copied into the parameters."""
        return sum(g.out.numel() * g.out.element_size() for g in self.inflight.values())

    def _build(self, order: list[int]) -> None:
        self.buckets = buckets([self.shards[i] for i in order], self.world, self.bucket_elems)
        index = {id(s): b for b, bucket in enumerate(self.buckets) for s in bucket}
        self.bucket_of = [index[id(s)] for s in self.shards]

    def _adopt_first_use_order(self) -> None:
        seen = list(dict.fromkeys(self._seen or []))
        order = seen + [i for i in range(len(self.shards)) if i not in set(seen)]
        self._seen = None
        if self.world > 1:
            t = torch.tensor(order, dtype=torch.int64, device=self.device)
            broadcast(t, dist.get_global_rank(self.group, 0), self.group)
            order = t.tolist()
        self._build(order)

    @property
    def pending(self) -> bool:
        return self.done < len(self.buckets)

    def start(self) -> None:
        """Launch the first buckets of a new refresh (the masters were just updated)."""
        self.finish()
        if self._seen is not None:
            self._adopt_first_use_order()
        self.next = self.done = 0
        self._launch_upto(self.depth)

    def _launch_upto(self, end: int) -> None:
        while self.next < min(end, len(self.buckets)):
            self.inflight[self.next] = start_gather(self.buckets[self.next], self.dtype, self.world, self.group,
                                                    async_op=True, device=self.device)
            self.next += 1

    def wait_for(self, index: int) -> None:
        """Complete buckets up to `index` (in order), keeping `depth` more in flight."""
        with torch.no_grad():
            while self.done <= index and self.done < len(self.buckets):
                self._launch_upto(self.done + 1)
                gather = self.inflight.pop(self.done)
                # `.data`: autograd must not see this write (no version-counter bump on the leaf).
                gather.copy_out([s.param.data for s in gather.shards])
                self.done += 1
                self._launch_upto(self.done + self.depth)

    def finish(self) -> None:
        self.wait_for(len(self.buckets) - 1)

    def _refuse_stale(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.done < len(self.buckets):
            raise EngineUsageError(f"state_dict() of {type(module).__name__} while the parameters updated by the last "
                                   "step are still being gathered (stages 1-2): call engine.wait_params() on every "
                                   "rank first (or save with engine.save_checkpoint / engine.full_state_dict())")

    def _pre_forward(self, mine: list[int], module: nn.Module, args: Any) -> None:
        if self._seen is not None:
            self._seen.extend(mine)
        index = max(self.bucket_of[i] for i in mine)
        if self.done <= index:
            self.wait_for(index)
