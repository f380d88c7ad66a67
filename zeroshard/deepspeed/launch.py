"""add_config_arguments and init_distributed, as DeepSpeed spells them."""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--deepspeed, --deepspeed_config (and the deprecated --deepscale spellings)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (zeroshard.deepspeed)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta = datetime.timedelta(minutes=30),
                     init_method: str | None = None, dist_init_required: bool | None = None, config: object = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Create the default process group: env:// under torchrun (or the given rank/world_size),
    a one-rank group on a free port otherwise. nccl on CUDA, gloo on CPU, unless dist_backend says."""
    if dist.is_initialized() or dist_init_required is False:
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if rank >= 0 and world_size > 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout)
