"""Gradient buckets: full per-parameter gradients in, this rank's averaged fp32 shard out.

The engine calls `grad_ready(shard, grad)` from each parameter's post-accumulate-grad hook.
The hook only keeps the gradient (the caller drops `.grad`); when a bucket's last gradient
arrives, all of them are copied into the bucket (row layout, see layout.py) by one
`_foreach_copy_`, and the bucket is launched (reduce-scatter; all-reduce at stage 0, where the
partition has one "rank"). [Note: one copy per bucket] A GPU step of a small model is bound by
kernel launches and the hooks' Python, not by arithmetic: with a copy (and its views) per
parameter, the hooks were a sixth of a profiled H100 step's host time. Held gradients are
counted in `held` like bucket buffers. `finish()` launches what is left (parameters that got no
gradient contribute zeros), waits, and adds the results into `master.grad`.

Every rank must issue the same collectives in the same order, whatever order the hooks fire
in, so buckets are static and always launch in index order (a ready bucket waits for earlier
ones, as in DDP). At most two buckets are in flight: launching one first finishes the one
before the previous, so bucket buffers never add up to a full gradient. The initial order is \
reverse registration order; after the first reducing
backward, buckets are rebuilt once in the order rank 0 saw gradients arrive, which makes
later backwards launch them as early as possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from zeroshard.bucketing import greedy_groups
from zeroshard.engine.collectives import all_reduce, broadcast, reduce_scatter
from zeroshard.engine.layout import ParamShard, column_pairs
from zeroshard.errors import EngineUsageError


@dataclass(eq=False)
class _Bucket:
    shards: list[ParamShard]
    chunks: list[int]  # each shard's per-rank elements, in order
    total: int  # per-rank elements (sum of chunks)
    ready: set[int] = field(default_factory=set)  # shard indices arrived in this round
    held: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> gradient not copied yet
    buf: torch.Tensor | None = None  # [world * total] in the reduce dtype
    out: torch.Tensor | None = None  # [total]: this rank's reduced share
    work: Any = None  # async handle while in flight


class GradReducer:
    """Bucketed gradient reduction into `shard.master.grad` (fp32, averaged over ranks)."""

    def __init__(self, shards: Sequence[ParamShard], world: int, group: Any, all_reduce: bool,
                 reduce_dtype: torch.dtype, bucket_elems: int, overlap: bool,
                 device: torch.device | None = None) -> None:
        self.world = world  # the partition's world size (1 at stage 0)
        self.group = group
        self.ranks = dist.get_world_size(group)  # how many gradients get averaged
        self.all_reduce = all_reduce
        self.dtype = reduce_dtype
        self.bucket_elems = bucket_elems
        self.overlap = overlap
        # Low-precision sums may overflow: divide before communicating, not after.
        self.predivide = reduce_dtype != torch.float32
        self.shards = list(shards)
        # Where buckets live and collectives run; masters (and master.grad) may be on the host.
        self.device = device or (self.shards[0].master.device if self.shards else torch.device("cpu"))
        self._build([s.index for s in reversed(self.shards)])
        self._seen: list[int] | None = []  # arrival order, recorded until the one rebuild
        self._next = 0  # first bucket not launched yet
        self._done = 0  # first bucket not finished (waited and accumulated) yet
        self.held = 0  # bytes in bucket buffers now
        self.peak_held = 0  # ... and at most, since construction

    # -- layout ------------------------------------------------------------------------------

    def _build(self, order: list[int]) -> None:
        by_index = {s.index: s for s in self.shards}
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, tuple[_Bucket, int]] = {}
        for group in greedy_groups((by_index[i] for i in order), lambda s: self.world * s.chunk, self.bucket_elems):
            self._add_bucket(group)

    def _add_bucket(self, shards: list[ParamShard]) -> None:
        chunks = [s.chunk for s in shards]
        bucket = _Bucket(shards, chunks, sum(chunks))
        for position, s in enumerate(shards):
            self.bucket_of[s.index] = (bucket, position)
        self.buckets.append(bucket)

    # -- one reducing backward ---------------------------------------------------------------

    def begin(self) -> None:
        """Start a round; the hooks may call grad_ready until finish()."""
        for b in self.buckets:
            b.ready.clear()
            b.held.clear()
            b.buf = b.out = b.work = None
        self._next = self._done = self.held = 0

    def grad_ready(self, shard: ParamShard, grad: torch.Tensor) -> None:
        """Keep `grad` (the full gradient) for its bucket; fill and launch buckets that are due."""
        bucket, position = self.bucket_of[shard.index]
        if shard.index in bucket.ready:
            raise EngineUsageError(f"gradient of {shard.name!r} arrived twice in one backward")
        bucket.ready.add(shard.index)
        if shard.chunk:
            self._hold(bucket, position, grad)
        if self._seen is not None:
            self._seen.append(shard.index)
        if len(bucket.ready) == len(bucket.shards):
            self._fill(bucket)
            if self.overlap:
                self._launch_due()

    def _hold(self, bucket: _Bucket, position: int, grad: torch.Tensor) -> None:
        bucket.held[position] = grad
        self._account(grad.numel() * grad.element_size())

    def _account(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.held)

    def _fill(self, bucket: _Bucket) -> None:
        """Copy the bucket's held gradients into a fresh zeroed buffer (the zeros are the padding)."""
        bucket.buf = torch.zeros(self.world * bucket.total, dtype=self.dtype, device=self.device)
        self._account(bucket.buf.numel() * bucket.buf.element_size())
        if bucket.held:
            # (the hooks' gradients need no detach: they do not require grad)
            flats = [bucket.held[i].reshape(-1) if i in bucket.held else None for i in range(len(bucket.shards))]
            pairs = column_pairs(bucket.buf.view(self.world, bucket.total), bucket.chunks, flats)
            torch._foreach_copy_([r for _, r in pairs], [g for g, _ in pairs])
        self.held -= sum(g.numel() * g.element_size() for g in bucket.held.values())
        bucket.held.clear()
        if self.predivide:
            bucket.buf.div_(self.ranks)

    def _launch_due(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.shards):
                return
            self._launch(bucket)
            self._next += 1
            self._finish_upto(self._next - 2)

    def _launch(self, bucket: _Bucket) -> None:
        if self.all_reduce:
            bucket.out = bucket.buf
            bucket.work = all_reduce(bucket.buf, self.group, async_op=self.overlap)
        else:
            bucket.out = torch.empty(bucket.total, dtype=self.dtype, device=bucket.buf.device)
            self._account(bucket.out.numel() * bucket.out.element_size())
            bucket.work = reduce_scatter(bucket.out, bucket.buf, self.group, async_op=self.overlap)

    def _finish_upto(self, end: int) -> None:
        """Wait for buckets [done, end) in order, add them into master.grad, free their buffers."""
        if end <= self._done:
            return
        scale = 1.0 if self.predivide else 1.0 / self.ranks
        with torch.no_grad():
            for bucket in self.buckets[self._done: end]:
                if bucket.work is not None:
                    bucket.work.wait()
                # the bucket cast and scaled at once (a GPU step launches kernels per call, not
                # per element); each shard's gradient is its slice of that fresh fp32 tensor
                whole = bucket.out.to(torch.float32, copy=True)
                if scale != 1.0:
                    whole.mul_(scale)
                on = {whole.device: whole.split(bucket.chunks)}  # offloaded masters: the gradients go down together
                acc, parts = [], []
                for i, s in enumerate(bucket.shards):
                    if s.master.device not in on:
                        on[s.master.device] = whole.to(s.master.device).split(bucket.chunks)
                    part = on[s.master.device][i]
                    if s.master.grad is None:
                        s.master.grad = part
                    else:
                        acc.append(s.master.grad)
                        parts.append(part)
                if acc:
                    torch._foreach_add_(acc, parts)
                self.held -= sum(t.numel() * t.element_size()
                                 for t in {id(t): t for t in (bucket.buf, bucket.out)}.values())
                bucket.buf = bucket.out = bucket.work = None
        self._done = end

    def finish(self) -> None:
        """Launch the rest (missing gradients: `.grad` if set, else zeros), wait, accumulate."""
        for bucket in self.buckets[self._next:]:
            if bucket.buf is None:
                for position, s in enumerate(bucket.shards):
                    if s.index not in bucket.ready and s.param.grad is not None:
                        if s.chunk:
                            self._hold(bucket, position, s.param.grad.detach())
                        s.param.grad = None
                self._fill(bucket)
            self._launch(bucket)
            self._next += 1
            self._finish_upto(self._next - 2)
        self._finish_upto(len(self.buckets))
        if self._seen is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        """Adopt rank 0's arrival order for all later rounds (one small broadcast, once)."""
        seen = list(dict.fromkeys(self._seen))
        seen_set = set(seen)
        rest = [s.index for b in self.buckets for s in b.shards if s.index not in seen_set]
        self._seen = None
        if not self.shards:
            return
        t = torch.tensor(seen + rest, dtype=torch.int64, device=self.device)
        broadcast(t, dist.get_global_rank(self.group, 0), self.group)
        self._build(t.tolist())

    def held_bytes(self) -> int:
        """Bytes in bucket buffers right now (non-zero only during a reducing backward)."""
        return self.held
