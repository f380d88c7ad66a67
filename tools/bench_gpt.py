"""The sample GPT as the tool-against-tool benches build, train and save it (bench_consolidate,
bench_reshard): one model from the same flags and seed, each tool's ZeRO-3 / FSDP2 set-up, and
the torchrun launch of a bench's own worker mode."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)


def model_argv(args: argparse.Namespace) -> list[str]:
    """The model flags, to hand on to a worker."""
    return ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
            "--vocab", str(args.vocab)]


def init_group(deepspeed: bool) -> None:
    """The worker's gloo process group (through DeepSpeed when it is the tool under test)."""
    if deepspeed:
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo")
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")


def sample_gpt(args: argparse.Namespace) -> Any:
    """The sample GPT from the model flags, the same initial weights in every worker."""
    import torch

    from samples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=64, n_layer=args.n_layer, n_head=args.n_head,
                         n_embd=args.n_embd))


def fully_shard_blocks(model: Any) -> tuple[Any, Any]:
    """FSDP2 over every Block and the whole model, and a fresh AdamW over its sharded parameters."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def save_deepspeed(model: Any, x: Any, folder: str) -> None:
    """One AdamW step of a DeepSpeed ZeRO-3 engine, saved under tag `t` in `folder`."""
    import deepspeed
    import torch

    from samples.gpt import lm_loss

    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
    eng.backward(lm_loss(eng(x), x))
    eng.step()
    eng.save_checkpoint(folder, tag="t")


def launch(script: str, worker_argv: list[str], nproc: int, what: str, timeout: float) -> None:
    """`script` under torchrun with `nproc` CPU ranks (gloo, one thread each, the repository on the
    path); on failure, SystemExit with the ranks' last error lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
           *worker_argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        tail = "\n".join([ln for ln in r.stderr.splitlines() if ln.startswith("[rank")][-8:] or
                         r.stderr.splitlines()[-12:])
        raise SystemExit(f"{what} failed:\n{tail}")
