"""Gradient sharding, one object per policy, chosen once at initialize (engine.py delegates).

  AllReduceGrads        stage 0: plain data parallelism; gradients accumulate in `.grad` and are
                        all-reduced at the accumulation boundary (the partition has one "rank").
  ScatterAtBoundary     stage 1: gradients accumulate in `.grad`; at the boundary they are
                        reduce-scattered into this rank's fp32 gradient shard.
  ScatterEachBackward   stages 2 and 3: every backward reduce-scatters gradients into the shard
                        as they become ready and frees `.grad` at once.

The bucketing and collectives themselves are reducer.py's; these only say when and how.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from zeroshard.engine.layout import ParamShard
from zeroshard.engine.reducer import GradReducer


class GradSharding:
    """Base: owns the GradReducer; `reducing(boundary)` says whether a backward reduces."""

    partitioned = True  # master, gradient and optimizer state are cut across the world
    all_reduce = False
    every_backward = False

    def __init__(self, shards: Sequence[ParamShard], world: int, group: Any, reduce_dtype: torch.dtype,
                 bucket_elems: int, overlap: bool, device: torch.device) -> None:
        self.reducer = GradReducer(shards, world if self.partitioned else 1, group, all_reduce=self.all_reduce,
                                   reduce_dtype=reduce_dtype, bucket_elems=bucket_elems, overlap=overlap,
                                   device=device)

    def reducing(self, boundary: bool) -> bool:
        return self.every_backward or boundary


class AllReduceGrads(GradSharding):
    partitioned = False
    all_reduce = True


class ScatterAtBoundary(GradSharding):
    pass


class ScatterEachBackward(GradSharding):
    every_backward = True


def grad_sharding_for(stage: int) -> type[GradSharding]:
    return {0: AllReduceGrads, 1: ScatterAtBoundary}.get(stage, ScatterEachBackward)
