"""Engine load at another world size: the cost of verifying every byte read.

    OMP_NUM_THREADS=1 python tools/bench_load_elsewhere.py            # small GPT, 2 -> 3 ranks, ~1 min
    OMP_NUM_THREADS=1 python tools/bench_load_elsewhere.py --n-layer 12 --n-embd 768 --vocab 50304  # GPT-2 small

Saves the sample GPT (+ Adam, ZeRO-3) at --save-world ranks, then loads it at --load-world ranks,
alternating two readers (tools/benchlib.py's rotation, one warm-up repeat dropped): the shipped
one, which also reads (into scratch) and hashes the rest of every saved fragment a rank reads part
of, so every byte it loads is checked; and the same reader without that (partial fragments
unverified: what loads did before). Each load is the slowest rank's seconds; the figure is the
median and IQR of the paired ratio verified / unverified. Each side of the save/load is one
torchrun launch (gloo, CPU). Raw JSON: tools/results/bench_load_elsewhere.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import benchlib  # noqa: E402


def engine(args: argparse.Namespace):
    import torch

    import zeroshard

    sys.path.insert(0, str(ROOT / "samples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=args.vocab,
                          block_size=256))
    eng = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                               config={"zero_optimization": {"stage": 3}})
    x = torch.randint(0, args.vocab, (1, 16))
    eng.backward(torch.nn.functional.cross_entropy(eng(x).reshape(-1, args.vocab), x.reshape(-1)))
    eng.step()
    return eng


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard.format.reader as reader

    eng = engine(args)
    if args.save:
        eng.save_checkpoint(args.dir, tag="t")
        return
    shipped = reader.CheckpointReader.__init__

    def load(mode: str):
        def run() -> float:
            def init(self, *a, complete_fragments=False, **k):
                shipped(self, *a, complete_fragments=complete_fragments and mode == "verified", **k)
            reader.CheckpointReader.__init__ = init
            dist.barrier()
            start = time.perf_counter()
            eng.load_checkpoint(os.path.join(args.dir, "t"))
            seconds = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            return float(seconds.item())
        return run

    runs = benchlib.interleave({"verified": load("verified"), "unverified": load("unverified")}, args.rounds)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(runs))


def launch(nproc: int, args: argparse.Namespace, *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(29500 + os.getpid() % 1000), __file__, "--worker", "--n-layer", str(args.n_layer), "--n-embd",
           str(args.n_embd), "--n-head", str(args.n_head), "--vocab", str(args.vocab), *extra]
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-world", type=int, default=2)
    p.add_argument("--load-world", type=int, default=3)
    p.add_argument("--rounds", type=int, default=10, help="interleaved repeats after one warm-up")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--json", default=None, help="result file (default tools/results/bench_load_elsewhere.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    rep = benchlib.Report("bench_load_elsewhere", vars(args), scope=(
        f"CPU, gloo, save at world {args.save_world}, load at world {args.load_world}, "
        f"{benchlib.machine()['cores']} vCPUs, GPT {args.n_layer}L/{args.n_embd}d vocab {args.vocab} + AdamW, "
        f"stage 3, warm page cache"))
    with tempfile.TemporaryDirectory(prefix="zs-load-elsewhere-") as tmp:
        launch(args.save_world, args, "--save", "--dir", tmp)
        out = Path(tmp) / "runs.json"
        launch(args.load_world, args, "--dir", tmp, "--rounds", str(args.rounds), "--out", str(out))
        runs = json.loads(out.read_text())
    rep.runs("verified", runs["verified"], "load, every byte read verified (shipped)")
    rep.runs("unverified", runs["unverified"], "load, partial fragments unverified")
    rep.ratio("verify_cost", "verified", "unverified", "verified / unverified load time")
    path = rep.finish(args.json)
    print("\n" + rep.table() + f"\n\nraw JSON: {path}")


if __name__ == "__main__":
    main()
