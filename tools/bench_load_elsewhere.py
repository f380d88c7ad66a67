"""Engine load at another world size: the cost of verifying every byte read.

    OMP_NUM_THREADS=1 python tools/bench_load_elsewhere.py [--save-world 2] [--load-world 3] [--rounds 3]

Saves the sample GPT-2 small (124.5M params + Adam, ZeRO-3) at --save-world ranks, then loads it at
--load-world ranks, alternating two readers: the shipped one, which also reads (into scratch) and
hashes the rest of every saved fragment a rank reads part of, so every byte it loads is checked;
and the same reader without that (partial fragments unverified: what loads did before). Prints
the slowest rank's seconds per load. Each side is one torchrun launch (gloo, CPU).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def engine():
    import torch

    import zeroshard

    sys.path.insert(0, str(ROOT / "samples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, block_size=1024))
    eng = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                               config={"zero_optimization": {"stage": 3}})
    x = torch.randint(0, 50304, (1, 16))
    eng.backward(torch.nn.functional.cross_entropy(eng(x).reshape(-1, 50304), x.reshape(-1)))
    eng.step()
    return eng


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard.format.reader as reader

    eng = engine()
    if args.save:
        eng.save_checkpoint(args.dir, tag="t")
        return
    shipped = reader.CheckpointReader.__init__
    for _ in range(args.rounds):
        for mode in ("verified", "unverified"):
            def init(self, *a, complete_fragments=False, **k):
                shipped(self, *a, complete_fragments=complete_fragments and mode == "verified", **k)
            reader.CheckpointReader.__init__ = init
            dist.barrier()
            start = time.perf_counter()
            eng.load_checkpoint(os.path.join(args.dir, "t"))
            seconds = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if dist.get_rank() == 0:
                print(f"{mode:>10} load at world {dist.get_world_size()}: {seconds.item():.3f} s", flush=True)


def launch(nproc: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(29500 + os.getpid() % 1000), __file__, "--worker", *extra]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-world", type=int, default=2)
    p.add_argument("--load-world", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="zs-load-elsewhere-") as tmp:
        launch(args.save_world, "--save", "--dir", tmp)
        launch(args.load_world, "--dir", tmp, "--rounds", str(args.rounds))


if __name__ == "__main__":
    main()
