"""Memory tier benchmark (issue 26): saves and loads through the memory tier against local disk.

    python tools/bench_recovery.py                          # ~17M-param GPT (AdamW), 2 nodes x 1 rank
    python tools/bench_recovery.py --n-layer 2 --n-embd 256 --repeats 3   # quick

Two "nodes" on this host: 2 gloo ranks (spawned here), rank 0 with ZEROSHARD_HOST_ID=nodeA and
rank 1 with nodeB, each with its own memory folder under --shm (tmpfs); the durable root is on
the local disk (--disk). Each rep runs every operation once, in an order rotated from rep to rep
(paired and interleaved: all see the same machine noise); every timing is the slowest rank's,
after a barrier; the table gives the median over the reps and [min, max]:

  durable sync save     Checkpointer.save(disk) (fsync, commit): what a step waits for without tiers
  memory save blocks    save_memory() returns (snapshot + agreement + space check; R=1)
  memory commit R=1     save_memory() .. wait(): own file on tmpfs + the replica on the peer node
  memory commit R=0     the same without a replica (another Checkpointer, replicas=0)
  steps                 --steps training steps, nothing saving
  steps during R=1 save the same steps right after save_memory() returned (replica in flight)
  load local memory     Checkpointer.load() with tiers: every rank reads its own node's copy
  load from peer        node B's memory folder wiped first: the files its rank reads (its own, rank 0's
                        for buffers) come from node A over gloo, then the load
  then its replicas back  the rest of node B's folder (the replicas it keeps), on the background
                        thread after the load (timed here by wait(); training could run meanwhile)
  load local disk       Checkpointer.load(disk checkpoint) (a warm page cache: the file was just written)

Then the ratios the issue asks about. Losses are not compared here (tests/test_memory_tier.py
does that bit for bit). NVIDIA's local checkpointing, DCP and S3 baselines are not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OPS = ["durable sync save", "memory save blocks", "memory commit R=1", "memory commit R=0", "steps",
       "steps during R=1 save", "load local memory", "load from peer", "then its replicas back",
       "load local disk"]


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1",
                       "ZEROSHARD_HOST_ID": f"node{'AB'[rank]}"})
    import torch
    import torch.distributed as dist

    import zeroshard
    from samples.gpt import GPT, GPTConfig, lm_loss
    from zeroshard.checkpointing import TierPolicy

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  config={"zero_optimization": {"stage": 2}})
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, args.vocab, (2, 32), generator=gen)

    def step() -> None:
        engine.backward(lm_loss(engine(x), x))
        engine.step()

    step()
    shm, disk = Path(args.shm), Path(args.disk)
    one = zeroshard.Checkpointer(engine, tiers=TierPolicy(memory_dir=str(shm / "r1"), memory_keep_last=1))
    none = zeroshard.Checkpointer(engine, tiers=TierPolicy(memory_dir=str(shm / "r0"), memory_keep_last=1,
                                                           replicas=0))
    plain = zeroshard.Checkpointer(engine)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t0)

    def steps() -> None:
        for _ in range(args.steps):
            step()

    def durable_save() -> None:
        if rank == 0:
            shutil.rmtree(disk / "ckpt", ignore_errors=True)
        dist.barrier()
        times["durable sync save"].append(timed(lambda: plain.save(str(disk / "ckpt"), tag="t")))

    def memory_r1() -> None:
        dist.barrier()
        t0 = time.perf_counter()
        one.save_memory(tag="t")
        blocked = time.perf_counter() - t0
        one.wait()
        times["memory save blocks"].append(slowest(blocked))
        times["memory commit R=1"].append(slowest(time.perf_counter() - t0))

    def memory_r0() -> None:
        times["memory commit R=0"].append(timed(lambda: (none.save_memory(tag="t"), none.wait())))

    def plain_steps() -> None:
        times["steps"].append(timed(steps))

    def steps_during() -> None:
        dist.barrier()
        one.save_memory(tag="t")
        times["steps during R=1 save"].append(timed(steps))
        one.wait()

    def load_local() -> None:
        times["load local memory"].append(timed(lambda: one.load(None)))
        assert "every file from its own node" in one.last_recovery, one.last_recovery

    def load_peer() -> None:  # node B's folder wiped; the load fetches it back whole
        dist.barrier()
        if rank == 1:
            shutil.rmtree(one.memory.path)
        times["load from peer"].append(timed(lambda: one.load(None)))
        assert "fetched from peer nodes" in one.last_recovery, one.last_recovery
        times["then its replicas back"].append(timed(one.wait))  # in the background: training could go on

    def load_disk() -> None:
        times["load local disk"].append(timed(lambda: plain.load(str(disk / "ckpt" / "t"))))

    saves = [durable_save, memory_r1, memory_r0, plain_steps, steps_during]
    loads = [load_local, load_peer, load_disk]
    times: dict[str, list[float]] = {op: [] for op in OPS}
    for rep in range(args.warmup + args.repeats):
        if rep == args.warmup:
            times = {op: [] for op in OPS}  # warm-up reps touch memory and fill caches: not counted
        k, j = rep % len(saves), rep % len(loads)
        for fn in saves[k:] + saves[:k] + loads[j:] + loads[:j]:
            fn()
    nbytes = sum(f.stat().st_size for f in (disk / "ckpt" / "t").glob("rank-*"))
    if rank == 0:
        Path(out).write_text(json.dumps({"params": n_params, "bytes": nbytes, "times": times}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--disk", default=str(REPO), help="a folder on the local disk for the durable root")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO / "tests"))
    from distributed import free_port

    shm = tempfile.mkdtemp(prefix="zeroshard-bench-", dir=args.shm)
    disk = tempfile.mkdtemp(prefix="bench-recovery-", dir=args.disk)
    out = os.path.join(disk, "result.json")
    try:
        ns = argparse.Namespace(**{**vars(args), "shm": shm, "disk": disk})
        mp.start_processes(worker, args=(2, free_port(), ns, out), nprocs=2, start_method="spawn")
        result = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    report(result, args)


def report(result: dict, args: argparse.Namespace) -> None:
    times = result["times"]
    med = {op: statistics.median(v) for op, v in times.items()}
    load = os.getloadavg()[0]
    print(f"{result['params'] / 1e6:.1f}M params, AdamW, ZeRO-2, 2 nodes x 1 rank (gloo, one host); "
          f"{result['bytes'] / 1e6:.0f} MB of rank files; {args.repeats} reps (+{args.warmup} warm-up); "
          f"load average now {load:.1f}{' (busy machine: timings noisy)' if load > 4 else ''}")
    print(f"{'operation':<24}{'median s':>10}  [min, max]")
    for op in OPS:
        v = times[op]
        print(f"{op:<24}{med[op]:>10.4f}  [{min(v):.4f}, {max(v):.4f}]")
    per_step = med["steps"] / args.steps
    print(f"memory save blocks / durable sync save: {med['memory save blocks'] / med['durable sync save']:.1%} "
          f"(target <= 5%)")
    print(f"memory commit R=1 / R=0: {med['memory commit R=1'] / med['memory commit R=0']:.2f}x (target <= 1.5x)")
    print(f"steps during the R=1 save / steps: {med['steps during R=1 save'] / med['steps']:.2f}x (target <= 1.1x; "
          f"{per_step:.3f} s a step)")
    print(f"load from peer / local memory: {med['load from peer'] / med['load local memory']:.2f}x (target <= 1.5x); "
          f"local disk / local memory: {med['load local disk'] / med['load local memory']:.2f}x")


if __name__ == "__main__":
    main()
