"""hpZ (ZeRO++'s hierarchical partition): stage 3 whose unit gathers stay inside the node.

Ranks are laid out node by node (as torchrun numbers them): with L = zero_hpz_partition_size
ranks per node and K = N / L nodes, rank r = k·L + l. The primary partition is stage 3's, so
masters, gradients, optimizer state and checkpoints are exactly stage 3's. Besides it each rank
keeps a *secondary* partition in the compute dtype: for every parameter, the primary chunks of
the K ranks with its local rank l (one per node), K·chunk elements, Ψ/L in all.

  once per optimizer step   all-gather of the primary chunks among {k·L + l : k} (one rank per
                            node: the only parameter traffic that crosses nodes), into the
                            secondary partition; lazily, at the first gather after the masters
                            change (a step, a load), so every rank issues it at the same point.
  every unit gather         all-gather of the secondary partitions among the node's L ranks:
                            row l', node k' is rank k'·L + l''s chunk, reordered into rank order.

Gradients are reduce-scattered over the whole world as at stage 3 (ZeRO++ compresses those
separately, qgZ; not here). Per step and rank this moves (Ψ' padded): reduce-scatter Ψ'(N-1)/N,
secondary gather (Ψ'/L)(K-1)/K, unit gathers 2Ψ'(L-1)/L, and only the first two cross nodes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.engine.collectives import Gather, all_gather, buckets, start_gather
from zeroshard.engine.layout import ParamShard, rows_to_flat
from zeroshard.engine.param_offload import ResidentTier
from zeroshard.engine.stage3 import Stage3, Unit
from zeroshard.errors import ConfigError


def hpz_groups(world: int, size: int) -> tuple[Any, Any]:
    """(this rank's node group, its cross-node group of one rank per node). Collective: every
    rank creates every group, in the same order, as torch.distributed.new_group requires."""
    if world % size:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size={size} does not divide the world size {world}")
    rank, nodes = dist.get_rank(), world // size
    node = cross = None
    for k in range(nodes):
        g = dist.new_group([k * size + i for i in range(size)])
        node = g if rank // size == k else node
    for i in range(size):
        g = dist.new_group([k * size + i for k in range(nodes)])
        cross = g if rank % size == i else cross
    return node, cross


class Secondary(ResidentTier):
    """The secondary partition: per shard K·chunk elements (compute dtype, on the device)."""

    kind = "hpz"

    def __init__(self, shards: Sequence[ParamShard], dtype: torch.dtype, nodes: int, group: Any,
                 bucket_elems: int, device: torch.device) -> None:
        self.shards, self.dtype, self.nodes, self.group = list(shards), dtype, nodes, group
        self.bucket_elems, self.device = bucket_elems, device
        self.parts = {s.index: torch.empty(nodes * s.chunk, dtype=dtype, device=device) for s in self.shards}
        self.stale = True

    def update(self) -> None:
        self.stale = True  # the masters changed: gather again before the next use (no collective here)

    def ensure(self) -> None:
        if not self.stale:
            return
        with torch.no_grad():
            for bucket in buckets(self.shards, self.nodes, self.bucket_elems):
                gather = start_gather(bucket, self.dtype, self.nodes, self.group, async_op=False, device=self.device)
                rows = gather.out.view(self.nodes, -1) if gather.total else None
                for s, offset in zip(bucket, gather.offsets):
                    if s.chunk:
                        self.parts[s.index].view(self.nodes, s.chunk).copy_(rows[:, offset: offset + s.chunk])
        self.stale = False

    def report(self) -> dict[str, int]:
        return {"hpz_secondary": sum(t.numel() * t.element_size() for t in self.parts.values())}


class NodeGather(Gather):
    """A unit's in-node all-gather of secondary partitions: rows [L, K·chunk] per shard."""

    nodes: int = 1

    def copy_out(self, targets: Sequence[torch.Tensor | None]) -> None:
        self.wait()
        local = self.out.numel() // self.total if self.total else 0
        rows = self.out.view(local, self.total) if self.total else None
        for shard, offset, target in zip(self.shards, self.offsets, targets):
            if target is not None and shard.chunk:
                part = rows[:, offset: offset + self.nodes * shard.chunk].view(local, self.nodes, shard.chunk)
                # [l, k] -> [k, l]: rank k·L + l's chunk, in rank order.
                rows_to_flat(part.transpose(0, 1).reshape(self.nodes * local, shard.chunk), target.view(-1))


class HpzStage3(Stage3):
    """Stage 3 whose unit gathers read the secondary partition over the node group."""

    def __init__(self, module: nn.Module, shards: Sequence[ParamShard], dtype: torch.dtype, world: int,
                 size: int, bucket_elems: int, prefetch: bool, classes: Sequence[str],
                 predicate: Callable[[nn.Module], bool] | None, device: torch.device) -> None:
        node, cross = hpz_groups(world, size)
        super().__init__(module, shards, dtype, size, node, prefetch, classes, predicate, device)
        self.nodes = world // size
        self.tier = self.secondary = Secondary(shards, dtype, self.nodes, cross, bucket_elems, device)

    def _start(self, unit: Unit, async_op: bool) -> Gather:
        self.secondary.ensure()
        offsets, total = [], 0
        for s in unit.shards:
            offsets.append(total)
            total += self.nodes * s.chunk
        inp = torch.empty(total, dtype=self.dtype, device=self.device)
        for s, offset in zip(unit.shards, offsets):
            inp[offset: offset + self.nodes * s.chunk].copy_(self.secondary.parts[s.index])
        out = torch.empty(self.world * total, dtype=self.dtype, device=self.device)
        work = all_gather(out, inp, self.group, async_op=async_op) if total else None
        gather = NodeGather(list(unit.shards), offsets, total, out, work if async_op else None)
        gather.nodes = self.nodes
        return gather
