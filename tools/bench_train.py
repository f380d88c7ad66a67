"""Training benchmark: plain DDP vs PyTorch FSDP2 vs zeroshard ZeRO 0-3 (vs DeepSpeed ZeRO 1-3).

    python tools/bench_train.py                      # default: 2 ranks, gloo, fp32, 3 rounds, ~5 min on 2 cores
    python tools/bench_train.py --n-layer 8 --n-embd 256 --steps 30 --methods ddp,zs3,fsdp2
    python tools/bench_train.py --methods ddp,zs1,zs2,ds1,ds2 --buckets 5e6,25e6   # buckets swept alike

One invocation launches one `torchrun --nproc-per-node N` per method, one after another, all
with the same sample GPT (samples/gpt.py), the same initial weights, the same batches
(samples/data.py) and AdamW + gradient clipping 1.0, then prints one table:

- step ms: median wall time of forward + backward + optimizer step over the timed steps
  (after --warmup steps), the slowest rank's median; "x DDP" divides it by DDP's.
- final loss / max|dloss|: the last step's training loss (mean over ranks) and the largest
  difference from DDP's loss at the same step over all steps. fp32 runs should agree closely.
- model state MiB/rank: params + grads + optimizer state held by each rank at its peak, sampled
  after backward and after the optimizer step of each warmup step (untimed). DDP: tensor sizes of the full
  replica (gradient_as_bucket_view=True, so buckets are the grads). FSDP2: local shards of the
  DTensor params, grads and AdamW states. zeroshard: engine.memory_report(). DeepSpeed: its
  partitioned params, fp32 master partitions and optimizer state (approximate; see ds_memory).

DeepSpeed rows run only when `import deepspeed` works in --ds-python (default: this Python).

--buckets sweeps the gradient bucket size of every bucketed data-parallel method alike (DDP's
bucket_cap_mb, zeroshard's and DeepSpeed's reduce/allgather bucket sizes, in fp32 elements): each
method runs once per size per round (as METHOD@SIZE), each method's size with the lowest median
step is its pick, and the paired ratios compare the picks. Stage 3 (zeroshard, FSDP2, DeepSpeed)
gathers per Block and is not swept.
Internal: `--worker METHOD --out FILE` is one rank's side, run under torchrun by the parent.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
import benchlib  # noqa: E402

ALL_METHODS = ["ddp", "fsdp2", "zs0", "zs1", "zs2", "zs3", "ds1", "ds2", "ds3"]
BASE_LABELS = {"ddp": "DDP", "fsdp2": "FSDP2 fully_shard", "ds1": "DeepSpeed ZeRO-1",
               "ds2": "DeepSpeed ZeRO-2", "ds3": "DeepSpeed ZeRO-3",
               **{f"zs{k}": f"zeroshard stage {k}" for k in range(4)}}
SWEPT = ("ddp", "zs0", "zs1", "zs2", "ds1", "ds2")  # the methods --buckets applies to


def split_method(method: str) -> tuple[str, int]:
    """"zs1@5M" -> ("zs1", 5_000_000); "zs1" -> ("zs1", 0): 0 is the method's own bucket size."""
    base, _, size = method.partition("@")
    return base, (int(float(size[:-1]) * 1e6) if size else 0)


def with_bucket(base: str, elements: int) -> str:
    return f"{base}@{elements / 1e6:g}M"


def label(method: str) -> str:
    base, bucket = split_method(method)
    return BASE_LABELS[base] + (f" ({bucket / 1e6:g}M-element buckets)" if bucket else "")



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(m for m in ALL_METHODS if m != "zs0"),
                   help="comma-separated subset of " + ",".join(ALL_METHODS))
    p.add_argument("--nproc", type=int, default=2, help="ranks (world size)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before the timed ones")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo on CPU ranks; cuda: NCCL, one GPU per rank (LOCAL_RANK), times synchronized")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--rounds", type=int, default=3,
                   help="run every method this many times, interleaved (order rotated); figures are medians "
                        "over rounds of each round's ratio to the reference method")
    p.add_argument("--ddp-bucket-mb", type=float, default=0.0,
                   help="DDP bucket_cap_mb (0: a quarter of the model's fp32 bytes, so backward overlaps 4 "
                        "buckets' all-reduces instead of one bucket holding the whole model)")
    p.add_argument("--buckets", default="",
                   help="comma-separated gradient bucket sizes in fp32 elements (e.g. 5e6,25e6) swept for "
                        + ", ".join(SWEPT) + " alike; each method's fastest size is its pick for the ratios")
    p.add_argument("--timeout", type=int, default=600, help="seconds per method launch")
    p.add_argument("--ds-python", default=sys.executable,
                   help="Python interpreter (with deepspeed and torch) for the DeepSpeed rows")
    p.add_argument("--json", default=None, help="result file (default tools/results/bench_train.json)")
    p.add_argument("--profile", default="",
                   help="folder: after the timed steps, rank 0 profiles 3 more (torch.profiler, CPU and CUDA) "
                        "and writes <method>.txt there: kernel time against wall time, and the top operations")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker (one rank)

def tensor_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def optim_state_bytes(opt) -> int:
    import torch

    return sum(tensor_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


def plain_memory(model, opt) -> dict:
    """params/grads/optimizer bytes held by this rank (DTensors count their local shard)."""
    params = list(model.parameters())
    p = sum(tensor_bytes(q) for q in params)
    g = sum(tensor_bytes(q.grad) for q in params if q.grad is not None)
    o = optim_state_bytes(opt)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def ds_memory(engine, stage: int) -> dict:
    """Approximate model-state bytes of a DeepSpeed ZeRO engine on this rank: resident params
    (stage 3: the rank's partition plus any gathered ones), reduced gradient partitions, and the
    optimizer's state plus its fp32 master partitions (a separate copy even in fp32 runs)."""
    import torch

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))

    zopt = engine.optimizer
    params = list(engine.module.parameters())
    p = nbytes(q.data for q in params)  # stage 3: 0 elements unless gathered or persistent
    if stage == 3:
        p += nbytes(q.ds_tensor for q in params)
        masters = list(getattr(zopt, "fp32_partitioned_groups_flat", []))
    else:
        masters = list(getattr(zopt, "single_partition_of_fp32_groups", []))
    avg = getattr(zopt, "averaged_gradients", None)
    g = nbytes(q.grad for q in params if q.grad is not None) + nbytes(m.grad for m in masters)
    if isinstance(avg, dict):
        g += sum(nbytes(v) for v in avg.values() if v is not None)  # None after the step
    o = optim_state_bytes(getattr(zopt, "optimizer", zopt)) + nbytes(masters)
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from samples.data import get_batch, load_dataset
    from samples.gpt import GPT, GPTConfig, lm_loss

    method, bucket_elements = split_method(args.worker)
    cuda = args.device == "cuda"
    backend = "nccl" if cuda else "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if method.startswith("ds"):
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    else:
        dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    bf16 = args.dtype == "bf16"

    def sync() -> None:  # CUDA work is asynchronous: a step's time ends when its kernels do
        if cuda:
            torch.cuda.synchronize(device)

    tok, train_ids, _ = load_dataset()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    n_params = model.num_params()
    if cuda and not method.startswith("zs"):  # zeroshard places the model on its device itself
        model = model.to(device)

    def adamw(params):
        return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def clip(params):
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)

    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else None

    tuning = ""  # the settings this run gave the method, as it ran them (the report's notes quote it)
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        bucket = (bucket_elements * 4 / 2**20 if bucket_elements else
                  args.ddp_bucket_mb or max(0.05, n_params * 4 / 2**20 / 4))
        net = DDP(model, gradient_as_bucket_view=True, device_ids=[device.index] if cuda else None,
                  bucket_cap_mb=bucket)
        tuning = f"bucket_cap_mb={bucket:.1f}" + (" (--buckets)" if bucket_elements else
                                                  " (--ddp-bucket-mb)" if args.ddp_bucket_mb else
                                                  " (a quarter of the model's fp32 bytes)")
        opt = adamw(net.parameters())

        def forward(x):
            opt.zero_grad(set_to_none=True)  # here, so grads and optimizer state coexist after step()
            if autocast:
                with autocast():
                    return net(x)
            return net(x)

        def backward(loss):
            loss.backward()

        def step():
            clip(net.parameters())
            opt.step()

        def memory():
            return plain_memory(model, opt)

    elif method == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        # explicit prefetch of the next block's all-gather, as FSDP2's docs recommend for overlap
        blocks = list(model.blocks)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
            block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0):i] if i else [])
        tuning = "explicit forward/backward prefetch of the next/previous Block"
        opt = adamw(model.parameters())  # after sharding: the optimizer sees the DTensor shards

        def forward(x):
            opt.zero_grad(set_to_none=True)
            return model(x)

        def backward(loss):
            loss.backward()

        def step():
            clip(model.parameters())
            opt.step()

        def memory():
            return plain_memory(model, opt)

    elif method.startswith("zs"):
        import zeroshard

        buckets = {"reduce_bucket_size": bucket_elements, "allgather_bucket_size": bucket_elements}
        engine = zeroshard.initialize(model=model, optimizer=adamw(model.parameters()), config={
            "zero_optimization": {"stage": int(method[2:]),  # stage 3: per Block, as FSDP2 here
                                  **({"stage3_unit_classes": ["Block"]} if method == "zs3" else {}),
                                  **(buckets if bucket_elements else {})},
            "bf16": {"enabled": bf16}, "fp16": {"enabled": False},
            "gradient_accumulation_steps": 1, "gradient_clipping": args.grad_clip,
        })

        def forward(x):
            return engine(x)

        def backward(loss):
            engine.backward(loss)

        def zs_memory():
            # "optimizer" includes the fp32 master shards (as for DeepSpeed here); "comm" (in-flight
            # collective buffers) and "buffers" are outside model state and kept only in the JSON
            m = engine.memory_report()
            opt_bytes = m["optimizer"] if "optimizer_state" in m else m["optimizer"] + m.get("master", 0)
            out = {"params": m["params"], "grads": m["grads"], "optimizer": opt_bytes}
            out["total"] = sum(out.values())
            out["raw"] = m
            return out

        def step():
            engine.step()

        memory = zs_memory
        if bucket_elements:
            tuning = f"reduce_bucket_size=allgather_bucket_size={bucket_elements:g} (--buckets)"

    elif method.startswith("ds"):
        import deepspeed

        stage = int(method[2:])
        ds_cfg = {
            "train_batch_size": args.batch,
            "train_micro_batch_size_per_gpu": args.batch // world,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": args.grad_clip,
            # persistence threshold 0: shard every parameter at stage 3, as FSDP2 and zeroshard do
            # overlap_comm + contiguous_gradients: DeepSpeed's recommended ZeRO settings for speed
            "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                                  **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}),
                                  **({"reduce_bucket_size": bucket_elements, "allgather_bucket_size": bucket_elements}
                                     if bucket_elements else {})},
            "bf16": {"enabled": bf16},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()),
                                               config=ds_cfg)
        tuning = ", ".join(f"{k}={v}" for k, v in ds_cfg["zero_optimization"].items() if k != "stage")

        def forward(x):
            return engine(x)

        def backward(loss):
            engine.backward(loss)

        def step():
            engine.step()

        def memory():
            return ds_memory(engine, stage)
    else:
        raise SystemExit(f"unknown method {method!r}")

    losses, times, peak = [], [], {"total": -1}
    for s in range(args.warmup + args.steps):
        x, y = get_batch(train_ids, s, args.batch, args.block_size, seed=args.seed,
                         world_size=world, rank=rank)
        x, y = x.to(device), y.to(device)
        timed = s >= args.warmup  # memory is sampled in the warmup steps only, outside any timing
        sync()
        t0 = time.perf_counter()
        loss = lm_loss(forward(x), y)
        backward(loss)
        if not timed:
            peak = max(peak, memory(), key=lambda m: m["total"])
        step()
        if not timed:
            peak = max(peak, memory(), key=lambda m: m["total"])
        else:
            sync()
            times.append(time.perf_counter() - t0)
        lt = loss.detach().float().reshape(())
        dist.all_reduce(lt)
        losses.append(lt.item() / world)

    if args.profile:
        def one_step(s: int) -> None:
            x, y = get_batch(train_ids, s, args.batch, args.block_size, seed=args.seed, world_size=world, rank=rank)
            x, y = x.to(device), y.to(device)
            backward(lm_loss(forward(x), y))
            step()

        profiled = profile_steps(one_step, args.warmup + args.steps, Path(args.profile) / f"{method}.txt", rank,
                                 cuda, sync)

    med = torch.tensor(statistics.median(times), device=device)
    meds = [torch.zeros((), device=device) for _ in range(world)]
    dist.all_gather(meds, med)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "method": args.worker, "world_size": world, "n_params": n_params,
            "step_ms": 1000 * max(m.item() for m in meds), "step_ms_per_rank": [1000 * m.item() for m in meds],
            "losses": losses, "final_loss": losses[-1], "peak_memory": peaks,
            "torch": torch.__version__, "device": str(device if not cuda else torch.cuda.get_device_name(device)),
            "cuda_max_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
            "tuning": tuning, **({"profile": profiled} if args.profile else {}),
        }))
    dist.barrier()
    dist.destroy_process_group()


def profile_steps(one_step, first: int, out: Path, rank: int, cuda: bool, sync, n: int = 3) -> dict | None:
    """Profile n steps (every rank runs them, rank 0 records): where a step's wall time goes. Writes
    the profiler's tables to `out` and returns, on rank 0, the figures a document may quote: wall
    and kernel milliseconds per step, operations per step, and the top operations by self time
    (`top`: [name, self ms per step, calls per step])."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for s in range(first, first + n):
            one_step(s)
        sync()
        wall = time.perf_counter() - t0
    if rank != 0:
        return None
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events) if cuda else 0.0
    syncs = {e.key: e.count for e in events if "Synchronize" in e.key or "Memcpy" in e.key or "item" in e.key}
    out.parent.mkdir(parents=True, exist_ok=True)
    by = "self_device_time_total" if cuda else "self_cpu_time_total"
    out.write_text(
        f"{n} steps: wall {1000 * wall / n:.2f} ms/step, device (kernel) time {kernel_us / 1000 / n:.2f} ms/step, "
        f"operations {sum(e.count for e in events) / n:.0f}/step\nsync-like calls: {syncs}\n\n"
        + events.table(sort_by=by, row_limit=35) + "\n\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
    top = sorted(events, key=lambda e: getattr(e, by), reverse=True)[:15]
    return {"steps": n, "wall_ms_per_step": 1000 * wall / n, "device_ms_per_step": kernel_us / 1000 / n,
            "ops_per_step": sum(e.count for e in events) / n, "self_time": by,
            "top": [[e.key, getattr(e, by) / 1000 / n, e.count / n] for e in top]}


# ----------------------------------------------------------------------------- parent

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def importable(python: str, module: str) -> tuple[bool, str]:
    r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=300)
    last = (r.stderr.strip().splitlines() or [""])[-1]
    return r.returncode == 0, last


def launch(method: str, args: argparse.Namespace, python: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="zs-bench-") as tmp:
        out = Path(tmp) / "result.json"
        forward = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k in ("n_layer", "n_embd", "n_head", "block_size", "batch", "steps", "warmup",
                            "lr", "grad_clip", "dtype", "seed", "device", "ddp_bucket_mb", "profile")]
        cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               f"--master-port={free_port()}", str(Path(__file__).resolve()),
               "--worker", method, "--out", str(out), *forward]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "DS_ACCELERATOR": args.device, "PYTHONPATH": os.pathsep.join(
                   [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"method": method, "error": f"timed out after {args.timeout}s"}
        wall = time.perf_counter() - t0
        if r.returncode != 0 or not out.exists():
            lines = (r.stderr + r.stdout).strip().splitlines()
            ranked = [ln for ln in lines if ln.startswith("[rank")]  # the ranks' own tracebacks
            tail = "\n".join((ranked or lines)[-15:])
            return {"method": method, "error": f"exit {r.returncode}", "log_tail": tail}
        res = json.loads(out.read_text())
        res["launch_s"] = wall
        return res


def mib(n) -> str:
    return f"{n / 2**20:.2f}"


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    ddp = pick({r["method"]: r for r in results if "error" not in r}, "ddp")
    base = next((r for r in results if r["method"] == ddp and "error" not in r), None)
    n_params = next((r["n_params"] for r in results if "n_params" in r), 0)
    print()
    print(f"GPT {args.n_layer}L/{args.n_embd}d/{args.n_head}h, block {args.block_size}, "
          f"{n_params / 1e6:.3f}M params | global batch {args.batch} | world {args.nproc} "
          f"({'NCCL, CUDA' if args.device == 'cuda' else 'gloo, CPU'}) | "
          f"{args.dtype} | AdamW lr {args.lr}, clip {args.grad_clip} | median of {args.steps} steps "
          f"after {args.warmup} warmup" + (f", median of {args.rounds} rounds" if args.rounds > 1 else ""))
    hdr = (f"{'method':<34} {'step ms':>8} {'x DDP':>6} {'final loss':>10} {'max|dloss| 1-10/all':>19}   "
           f"{'model state MiB, rank 0: params/grads/optim = total':<52} {'total per rank':<16}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        name = label(r["method"])
        if "error" in r:
            print(f"{name:<34} {r.get('error')}")
            continue
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}" if base else "-"
        dloss = "-"
        if base and len(base["losses"]) == len(r["losses"]):
            diffs = [abs(a - b) for a, b in zip(r["losses"], base["losses"])]
            dloss = f"{max(diffs[:10]):.1e} / {max(diffs):.1e}"
        m0 = r["peak_memory"][0]
        breakdown = f"{mib(m0['params'])}/{mib(m0['grads'])}/{mib(m0['optimizer'])} = {mib(m0['total'])}"
        per_rank = " / ".join(mib(m["total"]) for m in r["peak_memory"])
        print(f"{name:<34} {r['step_ms']:8.1f} {ratio:>6} {r['final_loss']:10.4f} {dloss:>19}   "
              f"{breakdown:<52} {per_rank:<16}")
    if base:
        print(f"loss after step 1: {base['losses'][0]:.4f}. max|dloss|: largest |loss - DDP's loss| at the "
              f"same step, over steps 1-10 and over all {len(base['losses'])} steps (rounding differences "
              f"from other reduction orders grow over training, most at high learning rates).")


def report(results: list[dict], args: argparse.Namespace) -> benchlib.Report:
    """Per-round step times and each round's paired ratio to DDP (stages 0-2, DeepSpeed) or to
    FSDP2 (stage 3): the same round ran the methods minutes apart, not hours."""
    ok = {r["method"]: r for r in results if "error" not in r}
    n_params = next((r["n_params"] for r in ok.values()), 0)
    rep = benchlib.Report("bench_train", vars(args), scope=(
        f"{'CUDA, NCCL' if args.device == 'cuda' else 'CPU, gloo'}, world {args.nproc}, "
        f"{benchlib.machine()['cores']} vCPUs, GPT {args.n_layer}L/{args.n_embd}d = {n_params / 1e6:.2f}M params, "
        f"{args.dtype}, global batch {args.batch}, step = median of {args.steps} steps per launch"))
    for m, r in ok.items():
        rep.runs(m, [ms / 1000 for ms in r["step_ms_rounds"]], f"{label(m)}: step")
    picks = {base: pick(ok, base) for base in ALL_METHODS}
    assessed = n_params >= 50e6  # the targets are written for step times set by compute, not Python
    pairs = [(f"zs{k}", "ddp", "<= 1.05" if k in (1, 2) and assessed else None) for k in (0, 1, 2)]
    # on gloo FSDP2 pays gloo's all-gather/reduce-scatter, which the engine avoids: a transport
    # artifact, so stage 3 / FSDP2 meets or misses a target only on a GPU (NCCL)
    pairs += [("zs3", "fsdp2", "<= 1.0" if assessed and args.device == "cuda" else None), ("fsdp2", "ddp", None)]
    pairs += [(f"ds{k}", "ddp", None) for k in (1, 2, 3)] + [("zs3", "ds3", None)]
    for a, b, target in pairs:  # the ratio's key names the methods; its label, the bucket sizes picked
        pa, pb = picks[a], picks[b]
        if pa in ok and pb in ok and len(ok[pa]["step_ms_rounds"]) == len(ok[pb]["step_ms_rounds"]):
            rep.ratio(f"{a}_vs_{b}", pa, pb, f"{label(pa)} / {label(pb)} step time", target)
    for m, r in ok.items():
        rep.value(f"{m}_state_MiB", r["peak_memory"][0]["total"] / 2**20, "MiB", f"{label(m)}: model state, rank 0")
    for m, r in by_error(results).items():
        rep.note(f"{label(m)}: {r}")
    note = tuning_note(ok)
    if note:
        rep.note(note)
    if getattr(args, "buckets", ""):
        rep.note(sweep_note(ok, picks))
    if "zs3_vs_fsdp2" in rep.data["ratios"] and args.device != "cuda":
        rep.note("Stage 3 / FSDP2 on gloo is a transport figure, not a win: FSDP2 runs gloo's all-gather and "
                 "reduce-scatter, which the engine avoids on gloo; no target is assessed on it.")
    if n_params < 50e6:
        rep.note(f"{n_params / 1e6:.2f}M params is below the 50M the step-time targets are written for: Python "
                 f"overhead, not compute and communication, dominates these step times, so no target is "
                 f"assessed.")
    return rep


def tuning_note(ok: dict[str, dict]) -> str:
    """The competitors' settings, from the methods that ran and what each recorded: nothing is
    said of a method that did not run."""
    parts = [f"{label(m)} {r['tuning']}" for m, r in ok.items() if not m.startswith("zs") and r.get("tuning")]
    return "Tuning, as run: " + "; ".join(parts) + "." if parts else ""


def pick(ok: dict[str, dict], base: str) -> str:
    """The run that stands for `base` in the ratios: itself, or when its bucket size was swept, the
    size with the lowest median step (every swept method is picked the same way)."""
    if base in ok:
        return base
    swept = [m for m in ok if split_method(m)[0] == base]
    return min(swept, key=lambda m: ok[m]["step_ms"]) if swept else base


def sweep_note(ok: dict[str, dict], picks: dict[str, str]) -> str:
    """What --buckets swept and what each method picked, from the runs themselves."""
    parts = []
    for base in SWEPT:
        swept = sorted((m for m in ok if split_method(m)[0] == base), key=lambda m: split_method(m)[1])
        if swept:
            tried = ", ".join(f"{split_method(m)[1] / 1e6:g}M {ok[m]['step_ms'] / 1000:.3f} s" for m in swept)
            parts.append(f"{BASE_LABELS[base]} {tried}: picked {split_method(picks[base])[1] / 1e6:g}M")
    return ("Bucket sizes swept alike (fp32 elements; median step): " + "; ".join(parts) +
            ". Stage 3 gathers per Block and was not swept.")


def by_error(results: list[dict]) -> dict[str, str]:
    return {r["method"]: r["error"] for r in results if "error" in r}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.warmup < 2:
        raise SystemExit("--warmup must be >= 2: model-state memory is sampled in warmup steps, "
                         "and optimizer state exists only after the first step")
    if args.batch % args.nproc:
        raise SystemExit(f"--batch {args.batch} must be divisible by --nproc {args.nproc}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {ALL_METHODS}")
    try:
        buckets = [int(float(b)) for b in args.buckets.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"--buckets {args.buckets!r}: comma-separated element counts, e.g. 5e6,25e6") from None
    if any(b < 1000 for b in buckets):
        raise SystemExit(f"--buckets {args.buckets!r}: sizes are fp32 elements, at least 1000 each")
    if buckets:  # every swept method once per size, each size its own row
        methods = [with_bucket(m, b) if m in SWEPT else m for m in methods for b in (buckets if m in SWEPT else [0])]

    skipped = {}
    if any(m.startswith("zs") for m in methods):
        ok, why = importable(sys.executable, "zeroshard.engine")
        if not ok:
            for m in methods:
                if m.startswith("zs"):
                    skipped[m] = f"skipped: zeroshard.engine not importable ({why})"
    if any(m.startswith("ds") for m in methods):
        ok, why = importable(args.ds_python, "deepspeed")
        if not ok:
            for m in methods:
                if m.startswith("ds"):
                    skipped[m] = f"skipped: deepspeed not importable in {args.ds_python} ({why[:80]})"

    by_method: dict[str, dict] = {}
    t0, load_before = time.perf_counter(), benchlib.loadavg()
    for rnd in range(args.rounds):
        for m in benchlib.rotated(methods, rnd):
            if m in skipped:
                if rnd == 0:
                    by_method[m] = {"method": m, "error": skipped[m]}
                    print(f"[bench] {label(m)}: {skipped[m]}", flush=True)
                continue
            if "error" in by_method.get(m, {}):
                continue  # failed in an earlier round
            tag = f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else ""
            print(f"[bench] {label(m)}{tag} ...", end=" ", flush=True)
            res = launch(m, args, args.ds_python if m.startswith("ds") else sys.executable)
            if "error" in res:
                print(f"FAILED ({res['error']})\n{res.get('log_tail', '')}", flush=True)
                by_method[m] = res
                continue
            print(f"{res['step_ms']:.1f} ms/step, final loss {res['final_loss']:.4f} "
                  f"({res['launch_s']:.1f}s)", flush=True)
            first = by_method.setdefault(m, {**res, "step_ms_rounds": []})
            first["step_ms_rounds"].append(res["step_ms"])
            first["step_ms"] = statistics.median(first["step_ms_rounds"])
    results = [by_method[m] for m in methods]
    print_table(results, args)
    rep = report(results, args)
    rep.data["results"] = results  # per-method detail, as tools/gpu_suite.py reads it
    rep.data["load_before"] = load_before  # the report is made after the runs
    path = rep.finish(args.json)
    print("\n" + rep.table() + "\n\n" + "\n".join(rep.data["notes"]) + f"\n\nraw JSON: {path}")
    print(f"total {time.perf_counter() - t0:.0f}s")
    return 1 if any(r.get("error", "").startswith(("exit", "timed")) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
