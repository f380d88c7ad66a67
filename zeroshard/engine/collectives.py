"""Process-group set-up and the parameter all-gathers (bucketed, padded, equal-sized).

Gradients go the other way in reducer.py. Both use the row layout described in layout.py:
an all-gather input is this rank's padded master chunks concatenated (cast to the compute
dtype), its output a [world, total] tensor whose row r is rank r's input.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from zeroshard.bucketing import greedy_groups
from zeroshard.engine.comm_ledger import LEDGER
from zeroshard.engine.layout import ParamShard, column_pairs
from zeroshard.peers import record_hosts

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Every collective the engine issues goes through these four, which count it (comm_ledger.py).
def all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    LEDGER.record("all_gather", out.numel(), out.element_size(), group)
    if out.device.type == "cpu" and dist.get_backend(group) == "gloo":
        return _gather_by_broadcasts(out, inp, group, async_op)
    return _all_gather(out, inp, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """`inp` is scratch: on gloo it is summed in place (see _reduce_scatter_by_all_reduce)."""
    LEDGER.record("reduce_scatter", inp.numel(), inp.element_size(), group)
    if out.device.type == "cpu" and dist.get_backend(group) == "gloo":
        return _reduce_scatter_by_all_reduce(out, inp, group, async_op)
    return _reduce_scatter(out, inp, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    LEDGER.record("all_reduce", tensor.numel(), tensor.element_size(), group)
    return dist.all_reduce(tensor, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any) -> Any:
    """`src` is a global rank, as torch.distributed.broadcast takes it."""
    LEDGER.record("broadcast", tensor.numel(), tensor.element_size(), group)
    if tensor.is_complex():  # gloo in torch 2.8 refuses complex tensors (a Llama's freqs_cis): the same bytes
        tensor = torch.view_as_real(tensor)
    return dist.broadcast(tensor, src=src, group=group)


# On gloo (CPU ranks: the tests, the CPU benches) two collectives are replaced by faster ones
# that move the same bytes; NCCL keeps its own.
class _Works:
    """Several collectives waited for as one, then an optional copy."""

    def __init__(self, works: list[Any], then: Callable[[], Any] | None = None) -> None:
        self.works, self.then = works, then

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.then is not None:
            self.then()
            self.then = None


def _gather_by_broadcasts(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool) -> Any:
    """The same bytes as an all-gather, as one broadcast per rank: on gloo (CPU) that takes
    0.3x-0.5x the time of its all-gather at 2 and 4 ranks (16.9M fp32: 0.041 s against 0.127 s
    at 2 ranks; 0.081 s against 0.201 s at 4), for the stage 1-3 parameter gathers of every step."""
    pg = group or dist.group.WORLD
    ranks = [dist.get_global_rank(pg, i) for i in range(dist.get_world_size(pg))]  # broadcast wants global ranks
    rows = out.view(len(ranks), -1)
    rows[dist.get_rank(group)].copy_(inp)
    works = [dist.broadcast(row, src=src, group=group, async_op=True) for src, row in zip(ranks, rows)]
    return _started(_Works(works), async_op)


def _reduce_scatter_by_all_reduce(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool) -> Any:
    """This rank's row of the sum, from an all-reduce of `inp` in place: gloo's reduce-scatter
    takes 2x-2.6x the time of its all-reduce of the same tensor (16.9M fp32: 0.146 s against
    0.056 s at 2 ranks, 0.329 s against 0.164 s at 4), and every stage 2-3 step reduces its gradients."""
    row = inp.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
    work = dist.all_reduce(inp, group=group, async_op=True)
    return _started(_Works([work], then=lambda: out.copy_(row)), async_op)


def _started(handle: _Works, async_op: bool) -> _Works | None:
    if async_op:
        return handle
    handle.wait()
    return None


def ensure_process_group() -> torch.device:
    """Create the default process group if the script did not; return this rank's device.

    Under torchrun the env:// variables are set. Without them (a plain `python script.py`) we
    start a one-rank group on a free local port so the same script runs unchanged. Collective:
    the ranks exchange their host names, so that a lost peer can be named (zeroshard/peers.py).
    """
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=1, timeout=datetime.timedelta(minutes=10))
    record_hosts()
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


@dataclass
class Gather:
    """An all-gather of some shards' masters, possibly still in flight."""

    shards: list[ParamShard]
    offsets: list[int]
    total: int
    out: torch.Tensor  # [world * total]
    work: Any  # None when synchronous or already waited

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def copy_out(self, targets: Sequence[torch.Tensor | None]) -> None:
        """Wait, then write each shard's full tensor into its target (None: skip that shard)."""
        self.wait()
        if not self.total:
            return
        pairs = column_pairs(self.out.view(-1, self.total), [s.chunk for s in self.shards],
                             [None if t is None else t.view(-1) for t in targets])
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def start_gather(shards: Sequence[ParamShard], dtype: torch.dtype, world: int, group: Any,
                 async_op: bool, device: torch.device | None = None,
                 fill: Callable[[Sequence[ParamShard], list[torch.Tensor]], None] | None = None) -> Gather:
    """All-gather the masters of `shards`, cast to `dtype`, in one collective on `device`
    (default: the masters'; offloaded masters are copied up from host memory). `fill(shards,
    targets)` writes each shard's `chunk` elements instead (stage 3's offload_param tier)."""
    offsets, total = [], 0
    for s in shards:
        offsets.append(total)
        total += s.chunk
    if device is None:
        device = shards[0].master.device if shards else torch.device("cpu")
    inp = torch.empty(total, dtype=dtype, device=device)
    targets = list(inp.split([s.chunk for s in shards]))
    if fill is not None:
        fill(shards, targets)
    else:
        # From pinned host memory this is asynchronous, ordered before the collective. Masters
        # beside the buffer need no pinning check (one dispatcher call per tensor per step).
        masters = [s.master for s in shards]
        pinned = [m.device != device and m.is_pinned() for m in masters]
        if masters and all(p == pinned[0] for p in pinned):
            torch._foreach_copy_(targets, masters, non_blocking=pinned[0])
        else:
            for m, t, p in zip(masters, targets, pinned):
                t.copy_(m, non_blocking=p)
    out = torch.empty(world * total, dtype=dtype, device=device)
    work = all_gather(out, inp, group, async_op=async_op) if total else None
    return Gather(list(shards), offsets, total, out, work if async_op else None)


def buckets(shards: Iterable[ParamShard], world: int, bucket_elems: int) -> list[list[ParamShard]]:
    """Consecutive groups of shards whose gathered size stays near `bucket_elems` elements."""
    return greedy_groups(shards, lambda s: world * s.chunk, bucket_elems)


def gather_into_params(shards: Sequence[ParamShard], dtype: torch.dtype, world: int, group: Any,
                       bucket_elems: int, device: torch.device | None = None) -> None:
    """Refresh the full module parameters from every rank's masters (stages 1 and 2, after a step)."""
    with torch.no_grad():
        for bucket in buckets(shards, world, bucket_elems):
            # `.data`: autograd must not see this write (no version-counter bump on the leaf).
            start_gather(bucket, dtype, world, group, async_op=False, device=device).copy_out(
                [s.param.data for s in bucket])
