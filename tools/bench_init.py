"""Peak memory per rank of model set-up: zeroshard's zero_init vs FSDP2's meta-device recipe vs eager.

    python tools/bench_init.py                          # 99M params, world 2: ~1 min
    python tools/bench_init.py --dim 2048 --layers 30   # 1.02B params (needs ~20 GB free)

Each rank is a fresh process (gloo, CPU), so its peak RSS (VmHWM) covers exactly: importing
torch, building the model, setting it up, and the FIRST OPTIMIZER STEP (Adam state allocated):
- meta:  `with zeroshard.zero_init(): Model()` + zeroshard.initialize (stage 3),
- fsdp2: `with torch.device("meta"): Model()` + fully_shard per block and root + to_empty +
         reset_parameters (FSDP2's documented meta-device init),
- eager: Model() built whole on every rank + zeroshard.initialize (stage 3).
The bar for meta, after the first step: peak <= ZeRO's model state per rank, 16 bytes per parameter
over N ranks (fp32 master, its gradient shard and Adam's two moments: 4 x master), + 2 x the
largest unit (gathered for forward and backward) + 512 MiB (torch itself, activations). Before
2026-11-27 the bar left out the gradient shard (3 x master). Raw JSON: tools/results/bench_init.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (tools/, beside this script)
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


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: "mp.Queue") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import zeroshard

    before = benchlib.proc_status("VmRSS")
    torch.manual_seed(0)
    x = torch.randint(0, args.vocab, (1, 16))
    t0 = time.perf_counter()
    if args.mode == "fsdp2":  # FSDP2's recipe: build on meta, shard, materialize the shard, init it
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo")
        with torch.device("meta"):
            model = Model(args.dim, args.layers, args.vocab)
        built = time.perf_counter()
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        done, peak_init = time.perf_counter(), benchlib.proc_status("VmHWM")
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        master = sum(p.to_local().numel() * 4 for p in model.parameters())
    else:
        if args.mode == "meta":
            with zeroshard.zero_init():
                model = Model(args.dim, args.layers, args.vocab)
        else:
            model = Model(args.dim, args.layers, args.vocab)
        built = time.perf_counter()
        engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-4),
                                      {"zero_optimization": {"stage": 3}})
        done, peak_init = time.perf_counter(), benchlib.proc_status("VmHWM")
        engine.backward(engine(x).float().logsumexp(-1).mean())
        engine.step()  # the first optimizer step allocates Adam's state
        master = sum(info.master.numel() * 4 for _, info in engine.named_shards())
    stepped = time.perf_counter()
    largest = 4 * max(args.dim * 4 * args.dim + 4 * args.dim, args.vocab * args.dim)  # embed/head or up/down
    total = args.vocab * args.dim * 2 + args.layers * (8 * args.dim * args.dim + 7 * args.dim)
    peak, rss_after = benchlib.proc_status("VmHWM"), benchlib.proc_status("VmRSS")
    out.put({"rank": rank, "mode": args.mode, "params": total, "rss_before": before, "peak": peak,
             "rss_after": rss_after, "peak_init": peak_init, "master": master, "largest_unit": largest,
             "bar": master * 4 + 2 * largest + 512 * MiB, "build_s": built - t0, "init_s": done - built,
             "step_s": stepped - done})
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
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)  # 4 x 8.4M + 2 x 32.8M: 99M params (1.02B: 2048 x 30)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mode", choices=["meta", "eager", "fsdp2", "all"], default="all")
    ap.add_argument("--json", help="result file (default tools/results/bench_init.json)")
    args = ap.parse_args()
    modes = ["meta", "fsdp2", "eager"] if args.mode == "all" else [args.mode]
    rep = benchlib.Report("bench_init", vars(args), scope=(
        f"CPU, gloo, world {args.world}, {benchlib.machine()['cores']} vCPUs, fp32 + Adam, one process per rank "
        f"per mode (peak RSS = VmHWM: imports, build, init and the first optimizer step)"))
    rows = []
    for mode in modes:
        args.mode = mode
        rows += run(args)
    print(f"{'mode':<6}{'rank':>5}{'params':>14}{'init MiB':>9}{'peak MiB':>10}{'bar MiB':>9}{'ok':>4}"
          f"{'master MiB':>11}{'unit MiB':>9}{'build s':>8}{'init s':>8}{'step s':>8}")
    for r in rows:
        print(f"{r['mode']:<6}{r['rank']:>5}{r['params']:>14,}{r['peak_init'] / MiB:>9.0f}"
              f"{r['peak'] / MiB:>10.0f}{r['bar'] / MiB:>9.0f}"
              f"{'yes' if r['peak'] <= r['bar'] else 'no':>4}{r['master'] / MiB:>11.0f}"
              f"{r['largest_unit'] / MiB:>9.0f}{r['build_s']:>8.1f}{r['init_s']:>8.1f}{r['step_s']:>8.1f}")
    peak = {m: max(r["peak"] for r in rows if r["mode"] == m) for m in modes}
    peak_init = {m: max(r["peak_init"] for r in rows if r["mode"] == m) for m in modes}
    bar = max(r["bar"] for r in rows if r["mode"] == modes[0])
    for m in modes:
        rep.value(f"{m}_peak_init_MiB", peak_init[m] / MiB, "MiB", f"{m}: peak RSS per rank after set-up")
        rep.value(f"{m}_peak_MiB", peak[m] / MiB, "MiB", f"{m}: peak RSS per rank after the first step",
                  f"<= {bar / MiB:.0f}" if m == "meta" else None)
    for other in ("eager", "fsdp2"):
        if "meta" in peak and other in peak:
            rep.value(f"meta_vs_{other}_init", peak_init["meta"] / peak_init[other], "x",
                      f"zero_init / {other}: peak after set-up")
            rep.value(f"meta_vs_{other}", peak["meta"] / peak[other], "x", f"zero_init / {other}: peak after step")
    rep.data["rows"] = rows
    rep.note("One launch per mode: peak RSS of a fresh process is deterministic to a few MiB, so it is not "
             "repeated; the bar is ZeRO's 16 bytes per parameter over N (master, gradient shard, Adam: 4 x "
             "master) + 2 x the largest unit + 512 MiB.")
    path = rep.finish(args.json)
    print("\n" + rep.table() + f"\n\nraw JSON: {path}")
    sys.exit(0 if peak.get("meta", 0) <= bar else 1)


if __name__ == "__main__":
    main()
