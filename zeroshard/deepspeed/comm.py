"""deepspeed.comm: the torch.distributed functions scripts call through it."""

import os

from torch.distributed import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    is_initialized,
    reduce_scatter_tensor,
)

from zeroshard.deepspeed.launch import init_distributed

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier", "broadcast", "get_rank",
           "get_world_size", "is_initialized", "reduce_scatter_tensor", "init_distributed", "get_local_rank"]


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))
