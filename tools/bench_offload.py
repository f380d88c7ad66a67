"""offload_param at stage 3: per-rank peak host memory, and NVMe tier bandwidth against `dd`.

    python tools/bench_offload.py memory --layers 12 --dim 1024      # no offload / cpu / nvme
    python tools/bench_offload.py bandwidth --mib 512                # tier I/O vs dd oflag=direct
    python tools/bench_offload.py                                    # both, defaults

memory: for each of offload_param none / cpu / nvme (offload_optimizer cpu in all three), fresh
ranks (gloo, CPU) build the model under zero_init(), initialize at stage 3 and train 2 steps.
Reported per rank: peak RSS (VmHWM) minus the RSS after importing torch; the formula's 16Ψ/N
(fp32 master 4 + Adam m, v 8 + fp32 gradient shard 4 bytes per owned element), which the peak
exceeds by the gradient buckets, the optimizer's temporaries and allocator slack (kept small:
2-layer buckets, Adam without foreach), alike in all three runs; so the offload's cost is the
peak's difference from no offload's, next to what the formula says the tier holds in host
memory (cpu: the compute-dtype partition, 4Ψ/N in fp32; nvme: its staging buffers; the
partition itself is on disk). On a CPU-only machine the "device" is the host, so the device-side
saving of ZeRO-Infinity cannot show in RSS: the table shows where the bytes are.

bandwidth: an NvmeTier over Linear(dim, dim) units totalling --mib of fp32 partitions writes them
all (update) and reads them back in unit order with read-ahead; `dd` with O_DIRECT writes and reads
a file of the same size in unit-sized blocks on the same filesystem. Timings on a shared machine
vary: run it when the load average is low, and compare ratios, not absolute numbers.

Everything lands in tools/results/bench_offload.json (tools/benchlib.py: the memory figures as
single values, the bandwidth as runs of both sides and their paired ratios, tier/dd throughput).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402  (tools/, beside this script)

MiB = 1 << 20


class Model(nn.Module):
    """`layers` units of one Linear(dim, dim) each, plus a LayerNorm: Ψ ≈ layers · dim²."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, device: str, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import zeroshard

    base = benchlib.proc_status("VmRSS")
    torch.manual_seed(0)
    with zeroshard.zero_init():
        model = Model(args.dim, args.layers)
    # Small gradient buckets and a non-foreach Adam keep the transient memory (which the formula
    # leaves out) small next to what the formula counts.
    z: dict[str, Any] = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 2 * args.dim ** 2}
    if device != "none":
        z["offload_param"] = {"device": device, "nvme_path": args.dir, "buffer_count": 4}
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    engine = zeroshard.initialize(model, opt, {"zero_optimization": z})
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = engine(torch.randn(4, args.dim)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    step_s = (time.perf_counter() - t0) / args.steps
    owned = sum(s.chunk for s in engine.shards)
    report = engine.memory_report()
    tier_host = report.get("param_offload_host", 0) + report.get("param_offload_staging", 0)
    out.put({"rank": rank, "device": device, "params": sum(s.numel for s in engine.shards), "owned": owned,
             "peak": benchlib.proc_status("VmHWM") - base, "tier_host": tier_host,
             "tier_disk": report.get("param_offload_nvme", 0), "step_s": step_s,
             "stats": dict(getattr(engine.param_tier, "stats", {}))})
    engine.param_tier.close()
    torch.distributed.destroy_process_group()


def memory(args: argparse.Namespace, rep: benchlib.Report) -> None:
    rows = []
    for device in ("none", "cpu", "nvme"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, device, out)) for r in range(args.world)]
        for p in procs:
            p.start()
        rows += sorted((out.get(timeout=1800) for _ in procs), key=lambda r: r["rank"])
        for p in procs:
            p.join()
    plain = {r["rank"]: r["peak"] for r in rows if r["device"] == "none"}
    rep.data["n_params"] = rows[0]["params"]
    for r in rows:
        at = f"{r['device']}_r{r['rank']}"
        rep.value(f"peak_{at}_MiB", r["peak"] / MiB, "MiB", f"offload_param {r['device']}, rank {r['rank']}: "
                  "peak RSS - torch's")
        if r["device"] != "none":
            rep.value(f"added_{at}_MiB", (r["peak"] - plain[r["rank"]]) / MiB, "MiB",
                      f"offload_param {r['device']}, rank {r['rank']}: peak - no offload's peak")
            rep.value(f"tier_host_{at}_MiB", r["tier_host"] / MiB, "MiB",
                      f"offload_param {r['device']}, rank {r['rank']}: what the tier holds in host memory (formula)")
    rep.value("formula_16psi_over_n_MiB", 16 * rows[0]["owned"] / MiB, "MiB",
              "16 bytes x owned elements (the model-state formula), rank 0")
    for r in rows:
        if r["rank"] == 0:
            rep.value(f"step_{r['device']}_s", r["step_s"], "s", f"offload_param {r['device']}: seconds per step, "
                      f"mean of {args.steps}")
            if r["device"] == "nvme":
                rep.value("on_disk_nvme_MiB", r["tier_disk"] / MiB, "MiB", "offload_param nvme: partition on disk, "
                          "rank 0")


def _dd(args: list[str]) -> float:
    """The seconds dd reports for its copy."""
    text = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"\d+ bytes .* copied, ([\d.]+) s", text)
    if not m:
        raise SystemExit(f"could not read dd's output: {text!r}")
    return float(m.group(1))


def _tier_once(args: argparse.Namespace, layers: int) -> tuple[float, float, bool]:
    """(write, read) seconds of an NvmeTier over `layers` Linear(dim, dim) units; O_DIRECT used."""
    from zeroshard.engine.layout import build_shards
    from zeroshard.engine.param_offload import NvmeTier

    model = nn.ModuleList(nn.Linear(args.dim, args.dim, bias=False) for _ in range(layers))
    shards = build_shards(model, 1, 0, torch.device("cpu"))
    tier = NvmeTier([[s] for s in shards], torch.float32, torch.device("cpu"),
                    {"nvme_path": args.dir, "buffer_count": 4, "buffer_size": args.dim * args.dim}, 0)
    t0 = time.perf_counter()
    tier.update()
    tier.flush()
    os.fsync(tier.fd)
    write = time.perf_counter() - t0
    targets = [torch.empty(s.chunk) for s in shards]
    t0 = time.perf_counter()
    for u in range(len(shards)):
        tier.read_ahead(list(range(u + 1, len(shards))))
        tier.fill(u, [shards[u]], [targets[u]])
    read = time.perf_counter() - t0
    out = (write, read, tier.direct)
    tier.close()
    return out


def bandwidth(args: argparse.Namespace, rep: benchlib.Report) -> None:
    layers = max(1, args.mib * MiB // (args.dim * args.dim * 4))
    unit_bytes = args.dim * args.dim * 4
    path = os.path.join(args.dir, "dd-bench.bin")
    seconds: dict[str, list[float]] = {"tier_write": [], "tier_read": [], "dd_write": [], "dd_read": []}
    direct = True
    for i in range(args.warmup + args.repeat):  # tier and dd alternate first: a shared disk's load drifts
        got: dict[str, float] = {}
        for side in benchlib.rotated(["tier", "dd"], i):
            if side == "tier":
                got["tier_write"], got["tier_read"], direct = _tier_once(args, layers)
            else:
                oflag, iflag = (["oflag=direct"], ["iflag=direct"]) if direct else ([], [])
                got["dd_write"] = _dd(["if=/dev/zero", f"of={path}", f"bs={unit_bytes}", f"count={layers}",
                                       "conv=fsync", *oflag])
                got["dd_read"] = _dd([f"if={path}", "of=/dev/null", f"bs={unit_bytes}", *iflag])
                os.unlink(path)
        if i >= args.warmup:
            for k, v in got.items():
                seconds[k].append(v)
    what = f"{layers * unit_bytes / MiB:g} MiB in {layers} units of {unit_bytes / MiB:g} MiB"
    for k, v in seconds.items():
        tool, op = k.split("_")
        rep.runs(k, v, f"{'NVMe tier' if tool == 'tier' else 'dd, O_DIRECT' if direct else 'dd'} {op} of {what}")
    for op in ("write", "read"):
        rep.ratio(f"tier_vs_dd_{op}", f"tier_{op}", f"dd_{op}", f"tier / dd {op} throughput", target=">= 0.7",
                  invert=True)
    rep.data["o_direct"] = direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=["memory", "bandwidth", "both"], default="both")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=48)  # 48 x 1.05M: ~50M params
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mib", type=int, default=512, help="bandwidth: bytes of partitions to write and read")
    ap.add_argument("--repeat", type=int, default=10, help="bandwidth: alternating tier/dd runs")
    ap.add_argument("--warmup", type=int, default=1, help="bandwidth: alternating runs first, not counted")
    ap.add_argument("--json", default=None, help="result file (default tools/results/bench_offload.json)")
    ap.add_argument("--dir", help="where the NVMe files go (default: a temporary directory under the cwd)")
    args = ap.parse_args()
    what = {"both": "memory and bandwidth"}.get(args.what, args.what)
    rep = benchlib.Report("bench_offload", dict(vars(args)), scope=(
        f"CPU, gloo, {benchlib.machine()['cores']} vCPUs, stage 3 at world {args.world}, fp32, {what}; the "
        "NVMe tier's file and dd's on the same local filesystem"))
    with tempfile.TemporaryDirectory(dir=args.dir or ".") as tmp:
        args.dir = tmp
        if args.what in ("memory", "both"):
            memory(args, rep)
        if args.what in ("bandwidth", "both"):
            bandwidth(args, rep)
    path = rep.finish(args.json)
    print("\n" + rep.table() + f"\n\nraw JSON: {path}")
    sys.exit(0)


if __name__ == "__main__":
    main()
