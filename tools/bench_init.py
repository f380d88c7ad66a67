"""Peak memory of `zeroshard.initialize` per rank: a model built on meta vs built eagerly.

    python tools/bench_init.py                      # ~1.0B params, world 2, stage 3, meta then eager
    python tools/bench_init.py --layers 4 --mode meta   # quick check

Each rank is a fresh process (gloo, CPU), so its peak RSS (VmHWM) covers exactly: importing
torch, building the model, and initialize. The bar (docs/ENGINE.md, issue 10) for a meta-built
model: peak <= this rank's fp32 master + Adam state (2 x master) + 2 x the largest unit + 512 MiB.
Units here are the modules that hold parameters directly (stage 3's default).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn

MiB = 1 << 20


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, dim: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(layers)))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(idx)))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: "mp.Queue") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import zeroshard

    before = _status("VmRSS")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    if args.mode == "meta":
        with zeroshard.zero_init():
            model = Model(args.dim, args.layers, args.vocab)
    else:
        model = Model(args.dim, args.layers, args.vocab)
    built = time.perf_counter()
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) * 4
    total = sum(p.numel() for p in model.parameters())
    engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-4),
                                  {"zero_optimization": {"stage": 3}})
    done = time.perf_counter()
    master = sum(info.master.numel() * 4 for _, info in engine.named_shards())
    out.put({"rank": rank, "mode": args.mode, "params": total, "rss_before": before, "peak": _status("VmHWM"),
             "rss_after": _status("VmRSS"), "master": master, "largest_unit": largest,
             "bar": master * 3 + 2 * largest + 512 * MiB, "build_s": built - t0, "init_s": done - built})
    torch.distributed.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, out)) for r in range(args.world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)  # 30 x 33.6M + embeddings: 1.02B params
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mode", choices=["meta", "eager", "both"], default="both")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    rows = []
    for mode in (["meta", "eager"] if args.mode == "both" else [args.mode]):
        args.mode = mode
        rows += run(args)
    print(f"{'mode':<6}{'rank':>5}{'params':>14}{'peak MiB':>10}{'bar MiB':>9}{'ok':>4}"
          f"{'master MiB':>11}{'unit MiB':>9}{'build s':>8}{'init s':>8}")
    for r in rows:
        print(f"{r['mode']:<6}{r['rank']:>5}{r['params']:>14,}{r['peak'] / MiB:>10.0f}{r['bar'] / MiB:>9.0f}"
              f"{'yes' if r['peak'] <= r['bar'] else 'no':>4}{r['master'] / MiB:>11.0f}"
              f"{r['largest_unit'] / MiB:>9.0f}{r['build_s']:>8.1f}{r['init_s']:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(0 if all(r["peak"] <= r["bar"] for r in rows if r["mode"] == "meta") else 1)


if __name__ == "__main__":
    main()
