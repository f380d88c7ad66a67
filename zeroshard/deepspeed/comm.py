"""deepspeed.comm: the torch.distributed functions scripts call through it."""

from torch.distributed import (ReduceOp, all_gather, all_gather_into_tensor, all_reduce, barrier,  # noqa: F401
                               broadcast, get_rank, get_world_size, is_initialized, reduce_scatter_tensor)

from zeroshard.deepspeed.launch import init_distributed  # noqa: F401


def get_local_rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", 0))
