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
  replica floor         the bytes R=1 moves, by plain gloo send/recv alone (each rank file to the
                        other node, one after the other, in the tier's chunks, received into one
                        buffer touched beforehand and written nowhere): on one host, R=1 cannot
                        cost less than R=0 plus this
  steps                 --steps training steps, nothing saving
  steps during R=1 save the same steps right after save_memory() returned (replica in flight)
  load local memory     Checkpointer.load() with tiers: every rank reads its own node's copy
  load from peer        node B's memory folder wiped first: the files its rank reads (its own, rank 0's
                        for buffers) come from node A over gloo, then the load
  then its replicas back  the rest of node B's folder (the replicas it keeps), on the background
                        thread after the load (timed here by wait(); training could run meanwhile)
  load local disk       Checkpointer.load(disk checkpoint) (a warm page cache: the file was just written)
  load S3 (zeroshard)   Checkpointer.load(s3://...) from tools/s3_server.py (moto, in memory, --lean-ranges)
  DCP save/load X       torch.distributed.checkpoint save / load of the same tensors (each rank's rank
                        file as safetensors reads it) to tmpfs, the local disk, S3 (FsspecWriter, s3fs)
  NVIDIA save R=1 / R=2, NVIDIA load   nvidia-resiliency-ext 0.4.1's LocalCheckpointManager on tmpfs,
                        the same tensors, shimmed for CPU (see _nvidia); run only when it imports: it
                        installs with no dependencies into a venv that sees this one's packages:
      python -m venv /tmp/nvre && python -c "import site; print(site.getsitepackages()[0])" \
          > /tmp/nvre/lib/python3.11/site-packages/this-venv.pth
      /tmp/nvre/bin/pip install --no-deps nvidia-resiliency-ext==0.4.1 nvidia-ml-py pynvml defusedxml \
          -c tools/constraints.txt          # (never let pip resolve torch: it would pull a CUDA one)
      /tmp/nvre/bin/python tools/bench_recovery.py ...

Then a 1-rank job on node A (node B lost), paired and interleaved: the load of the 2-rank memory
checkpoint resharded to 1 rank from node A's copies, a load of a memory checkpoint saved at 1 rank
(the same-world-size memory load), a local-disk load. Then restart to first step: a fresh 2-rank
job spawned (Python start, torch import, process group, engine), its load (memory tier, local
disk, S3), one step: the wall-clock time from the spawn to the end of that step, sources
interleaved. Ratios the issue asks about close the report. Losses are not compared here
(tests/test_memory_tier.py does that bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench-recovery"
JOB = "bench-recovery"  # TierPolicy.job: the memory tier belongs to one named job
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

OPS = ["durable sync save", "memory save blocks", "memory commit R=1", "memory commit R=0", "replica floor",
       "steps",
       "steps during R=1 save", "load local memory", "load from peer", "then its replicas back",
       "load local disk", "load S3 (zeroshard)", "DCP save tmpfs", "DCP load tmpfs", "DCP save disk",
       "DCP load disk", "DCP save S3", "DCP load S3", "NVIDIA save R=1", "NVIDIA save R=2 (clique)",
       "NVIDIA load"]
NEW_OPS = ["new world: load resharded from surviving memory", "new world: same-world-size memory load",
           "new world: load from local disk"]
RESTART_OPS = ["restart to first step: memory", "restart to first step: local disk", "restart to first step: S3"]


def _engine(rank: int, world: int, port: int, args: argparse.Namespace, host: str) -> tuple[Any, Any]:
    """The process group and the sample GPT's engine, one step taken; returns (engine, step)."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1",
                       "ZEROSHARD_HOST_ID": host})
    import torch
    import torch.distributed as dist

    import zeroshard
    from samples.gpt import GPT, GPTConfig, lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  config={"zero_optimization": {"stage": 2}})
    x = torch.randint(0, args.vocab, (2, 32), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        engine.backward(lm_loss(engine(x), x))
        engine.step()
    return engine, step


def _timers(times: dict[str, list[float]]) -> tuple[Callable[[float], float], Callable[..., float]]:
    import torch
    import torch.distributed as dist

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(op: str, fn: Callable[[], Any]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        seconds = slowest(time.perf_counter() - t0)
        times[op].append(seconds)
        return seconds
    return slowest, timed


def _rotated(fns: list[Callable[[], None]], rep: int) -> list[Callable[[], None]]:
    k = rep % len(fns)
    return fns[k:] + fns[:k]


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    engine, step = _engine(rank, world, port, args, f"node{'AB'[rank]}")
    import torch.distributed as dist

    import zeroshard
    from zeroshard.checkpointing import TierPolicy

    n_params = sum(p.numel() for p in engine.module.parameters())
    shm, disk = Path(args.shm), Path(args.disk)
    one = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=JOB, memory_dir=str(shm / "r1"), memory_keep_last=1))
    none = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=JOB, memory_dir=str(shm / "r0"), memory_keep_last=1,
                                                           replicas=0))
    plain = zeroshard.Checkpointer(engine)
    times: dict[str, list[float]] = {op: [] for op in OPS}
    slowest, timed = _timers(times)
    s3 = f"s3://{BUCKET}/zs" if args.endpoint else None

    def steps() -> None:
        for _ in range(args.steps):
            step()

    def durable_save() -> None:
        if rank == 0:
            shutil.rmtree(disk / "ckpt", ignore_errors=True)
        dist.barrier()
        timed("durable sync save", lambda: plain.save(str(disk / "ckpt"), tag="t"))

    def memory_r1() -> None:
        dist.barrier()
        t0 = time.perf_counter()
        one.save_memory(tag="t")
        blocked = time.perf_counter() - t0
        one.wait()
        times["memory save blocks"].append(slowest(blocked))
        times["memory commit R=1"].append(slowest(time.perf_counter() - t0))

    def memory_r0() -> None:
        timed("memory commit R=0", lambda: (none.save_memory(tag="t"), none.wait()))

    def replica_floor() -> None:
        import torch

        from zeroshard.checkpointing.replicas import CHUNK_BYTES, map_file

        rank_files = sorted((disk / "ckpt" / "t").glob("rank-*"))  # the same bytes as the memory tier's
        into = torch.empty(CHUNK_BYTES, dtype=torch.uint8).zero_()  # touched once, reused

        def move() -> None:  # the tier's chunks, received into memory already touched, written nowhere
            for src in range(world):
                dst = (src + 1) % world
                data = map_file(str(rank_files[src]))
                for at in range(0, data.numel(), CHUNK_BYTES):
                    if rank == src:
                        dist.send(data[at:at + CHUNK_BYTES], dst)
                    elif rank == dst:
                        dist.recv(into[:min(CHUNK_BYTES, data.numel() - at)], src)
        timed("replica floor", move)

    def plain_steps() -> None:
        timed("steps", steps)

    def steps_during() -> None:
        dist.barrier()
        one.save_memory(tag="t")
        timed("steps during R=1 save", steps)
        one.wait()

    def load_local() -> None:
        timed("load local memory", lambda: one.load(None))
        assert "every file from its own node" in one.last_recovery, one.last_recovery

    def load_peer() -> None:  # node B's folder wiped; the load fetches it back whole
        dist.barrier()
        if rank == 1:
            shutil.rmtree(one.memory.path)
        timed("load from peer", lambda: one.load(None))
        assert "fetched from peer nodes" in one.last_recovery, one.last_recovery
        timed("then its replicas back", one.wait)  # in the background: training could go on

    def load_disk() -> None:
        timed("load local disk", lambda: plain.load(str(disk / "ckpt" / "t")))

    def load_s3() -> None:
        timed("load S3 (zeroshard)", lambda: plain.load(f"{s3}/t"))

    plain.save(str(disk / "ckpt"), tag="t")  # the state the baselines save: this rank's file's tensors
    dist.barrier()  # rank 0 commits (moves the staged folder into place) after the others return
    if s3:
        plain.save(s3, tag="t")
    baselines = _baselines(rank, world, disk / "ckpt" / "t", shm, disk, args, timed)
    saves = [durable_save, memory_r1, memory_r0, replica_floor, plain_steps, steps_during] + baselines[0]
    loads = [load_local, load_peer, load_disk] + ([load_s3] if s3 else []) + baselines[1]
    for rep in range(args.warmup + args.repeats):
        if rep == args.warmup:
            for v in times.values():
                v.clear()  # warm-up reps touch memory and fill caches: not counted
        for fn in _rotated(saves, rep) + _rotated(loads, rep):
            fn()
    measured = {op: list(v) for op, v in times.items()}  # the timelines' runs are not counted
    timelines = _timelines(rank, one, memory_r1, load_peer) if args.timeline else None
    one.save_memory(tag="t")  # what the restarted and the smaller jobs recover from
    one.wait()
    nbytes = sum(f.stat().st_size for f in (disk / "ckpt" / "t").glob("rank-*"))
    if rank == 0:
        Path(out).write_text(json.dumps({"params": n_params, "bytes": nbytes, "times": measured,
                                         **({"timelines": timelines} if timelines else {})}))
    dist.barrier()
    dist.destroy_process_group()


def _timelines(rank: int, one: Any, memory_r1: Callable[[], None], load_peer: Callable[[], None]) -> list:
    """--timeline: one more R=1 save (to its commit) and one peer load, each under a per-thread
    timeline on every rank (tools/thread_timeline.py); every rank's, gathered to rank 0."""
    import torch.distributed as dist
    from thread_timeline import ThreadTimeline

    mine = {}
    for name, op in (("memory commit R=1", memory_r1), ("load from peer", load_peer)):
        with ThreadTimeline() as timeline:
            op()
            one.wait()  # the peer load's replicas back, too
        mine[name] = {"summary": timeline.summary(), "text": timeline.report()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _baselines(rank: int, world: int, rank_files: Path, shm: Path, disk: Path, args: argparse.Namespace,
               timed: Callable[..., float]) -> tuple[list, list]:
    """torch DCP (tmpfs, disk, S3) and NVIDIA's local checkpointing (when importable) on the same
    tensors: this rank's rank file as safetensors reads it (the same bytes, the same tensor count)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    name = sorted(rank_files.glob(f"rank-{rank:05d}-*"))[0]
    state = {f"r{rank}.{k}": v for k, v in load_file(str(name)).items()}
    places = {"tmpfs": str(shm / "dcp"), "disk": str(disk / "dcp")}
    if args.endpoint:
        places["S3"] = f"s3://{BUCKET}/dcp"
    saves, loads = [], []
    for where, path in places.items():
        def writer(path: str = path) -> Any:
            if path.startswith("s3://"):
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
                return FsspecWriter(path, sync_files=False)
            return dcp.FileSystemWriter(path)

        def reader(path: str = path) -> Any:
            if path.startswith("s3://"):
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
                return FsspecReader(path)
            return dcp.FileSystemReader(path)

        def save(where: str = where, path: str = path, writer: Any = writer) -> None:
            if rank == 0 and not path.startswith("s3://"):
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            timed(f"DCP save {where}", lambda: dcp.save(state, storage_writer=writer()))

        def load(where: str = where, reader: Any = reader) -> None:
            target = {k: v.clone() for k, v in state.items()}  # fresh tensors, allocated outside the timing
            timed(f"DCP load {where}", lambda: dcp.load(target, storage_reader=reader()))
        saves.append(save)
        loads.append(load)
    nvidia = _nvidia(rank, world, state, shm, timed)
    return saves + nvidia[0], loads + nvidia[1]


def _nvidia(rank: int, world: int, state: dict, shm: Path, timed: Callable[..., float]) -> tuple[list, list]:
    """NVIDIA Resiliency Extension's LocalCheckpointManager (0.4.1), shimmed for CPU: its
    BasicTensorAwareStateDict asserts every tensor is_cuda (skipped here) and moves tensors back
    to CUDA after a load (a no-op here); its save is synchronous (async needs CUDA streams).
    R=1: no replication; R=2: CliqueReplicationStrategy, replication_jump 1, factor 2 (the 2 nodes).
    gloo cannot broadcast uint64, so a uint64 tensor goes to it viewed as int64 (the same bytes)."""
    import torch

    state = {k: v.view(torch.int64) if v.dtype == torch.uint64 else v for k, v in state.items()}
    if OnCPU is None:
        return [], []
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    plain = LocalCheckpointManager(str(shm / "nv1"), session_id="bench")
    clique = LocalCheckpointManager(str(shm / "nv2"), session_id="bench",
                                    repl_strategy=CliqueReplicationStrategy.from_replication_params(1, 2))
    iteration = [0]

    def save(manager: Any, op: str) -> Callable[[], None]:
        def run() -> None:
            iteration[0] += 1
            manager.find_latest()
            timed(op, lambda: manager.save(OnCPU(dict(state)), iteration[0]))
        return run

    def load() -> None:
        plain.find_latest()
        timed("NVIDIA load", lambda: plain.load()[0].restore_tensor_device())
    return [save(plain, "NVIDIA save R=1"), save(clique, "NVIDIA save R=2 (clique)")], [load]


def _on_cpu() -> Any:
    """NVIDIA's BasicTensorAwareStateDict shimmed for CPU (module level: its manager pickles it)."""
    try:
        from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import BasicTensorAwareStateDict
    except ImportError:
        return None

    class OnCPU(BasicTensorAwareStateDict):
        def __init__(self, state_dict: dict) -> None:  # the shim: no is_cuda assertion
            self.state_dict = state_dict
            self._is_hollow = False

        def restore_tensor_device(self, non_blocking: bool = True) -> None:  # the shim: stays on CPU
            pass
    OnCPU.__qualname__ = "OnCPU"
    return OnCPU


OnCPU = _on_cpu()


def smaller(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """The job goes on with fewer ranks (node B lost): node A alone loads from its memory folder (the
    2-rank checkpoint, resharded), against a memory checkpoint saved at this world size and a disk load."""
    engine, step = _engine(rank, world, port, args, "nodeA")
    import zeroshard
    from zeroshard.checkpointing import TierPolicy

    shm, disk = Path(args.shm), Path(args.disk)
    survivor = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=JOB, memory_dir=str(shm / "r1")))
    same = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=JOB, memory_dir=str(shm / "w1"), memory_keep_last=1))
    plain = zeroshard.Checkpointer(engine)
    same.save_memory(tag="t")
    same.wait()
    times: dict[str, list[float]] = {op: [] for op in NEW_OPS}
    _, timed = _timers(times)

    def resharded() -> None:
        timed(NEW_OPS[0], lambda: survivor.load(None))
        assert "resharded from world size 2 to 1" in survivor.last_recovery, survivor.last_recovery

    def same_size() -> None:
        timed(NEW_OPS[1], lambda: same.load(None))
        assert "resharded" not in same.last_recovery, same.last_recovery

    def from_disk() -> None:
        timed(NEW_OPS[2], lambda: plain.load(str(disk / "ckpt" / "t")))
    for rep in range(args.warmup + args.repeats):
        if rep == args.warmup:
            for v in times.values():
                v.clear()
        for fn in _rotated([resharded, same_size, from_disk], rep):
            fn()
    step()
    Path(out).write_text(json.dumps(times))


def restart(rank: int, world: int, port: int, args: argparse.Namespace, out: str, source: str) -> None:
    """A restarted job: process start, engine, load (memory tier, disk or S3), one step; writes the
    wall-clock time the first step ended (the parent started its clock before spawning)."""
    engine, step = _engine(rank, world, port, args, f"node{'AB'[rank]}")
    import torch.distributed as dist

    import zeroshard
    from zeroshard.checkpointing import TierPolicy

    shm, disk = Path(args.shm), Path(args.disk)
    if source == "memory":
        ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=JOB, memory_dir=str(shm / "r1")))
        ckpt.load(None)
        assert "memory tier" in ckpt.last_recovery, ckpt.last_recovery
    else:
        zeroshard.Checkpointer(engine).load(str(disk / "ckpt" / "t") if source == "disk" else f"s3://{BUCKET}/zs/t")
    step()
    dist.barrier()
    if rank == 0:
        Path(out).write_text(str(time.time()))
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
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 baselines (no moto server)")
    parser.add_argument("--json", default=None, help="also write the raw timings here")
    parser.add_argument("--timeline", action="store_true",
                        help="then one more R=1 save and peer load under a per-thread timeline on each rank")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    sys.path.insert(0, str(REPO / "tests"))
    from distributed import free_port

    shm = tempfile.mkdtemp(prefix="zeroshard-bench-", dir=args.shm)
    disk = tempfile.mkdtemp(prefix="bench-recovery-", dir=args.disk)
    out = os.path.join(disk, "result.json")
    server = None
    try:
        endpoint = None
        if not args.no_s3:
            server, endpoint = _start_s3()
            os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
        ns = argparse.Namespace(**{**vars(args), "shm": shm, "disk": disk, "endpoint": endpoint})
        mp.start_processes(worker, args=(2, free_port(), ns, out), nprocs=2, start_method="spawn")
        result = json.loads(Path(out).read_text())
        mp.start_processes(smaller, args=(1, free_port(), ns, out), nprocs=1, start_method="spawn")
        result["new world"] = json.loads(Path(out).read_text())
        restarts: dict[str, list[float]] = {op: [] for op in RESTART_OPS}
        sources = ["memory", "disk"] + ([] if args.no_s3 else ["S3"])
        for rep in range(args.warmup + args.repeats):
            for source in sources[rep % len(sources):] + sources[:rep % len(sources)]:
                t0 = time.time()
                mp.start_processes(restart, args=(2, free_port(), ns, out, source.lower()), nprocs=2,
                                   start_method="spawn")
                if rep >= args.warmup:
                    label = {"memory": RESTART_OPS[0], "disk": RESTART_OPS[1], "S3": RESTART_OPS[2]}[source]
                    restarts[label].append(float(Path(out).read_text()) - t0)
        result["restart"] = restarts
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    result["load_average"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    report(result, args)


def _start_s3() -> tuple[subprocess.Popen, str]:
    """tools/s3_server.py (moto, in memory, ranged GETs reading only their range) with the bucket."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "s3_server.py"), "--port", "0", "--bucket",
                             BUCKET, "--lean-ranges"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline().strip() if proc.stdout else ""
    if not line.startswith("S3 endpoint "):
        proc.kill()
        raise SystemExit(f"moto server did not start: {line!r}")
    return proc, line.split()[-1]


def _row(op: str, v: list[float]) -> str:
    if not v:
        return f"{op:<50}{'not run':>10}"
    return f"{op:<50}{statistics.median(v):>10.4f}  [{min(v):.4f}, {max(v):.4f}]"


def report(result: dict, args: argparse.Namespace) -> None:
    times = {**result["times"], **result["new world"], **result["restart"]}
    med = {op: statistics.median(v) for op, v in times.items() if v}
    load = result["load_average"]
    print(f"{result['params'] / 1e6:.1f}M params, AdamW, ZeRO-2, 2 nodes x 1 rank (gloo, one host); "
          f"{result['bytes'] / 1e6:.0f} MB of rank files; {args.repeats} reps (+{args.warmup} warm-up); "
          f"load average at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
          f"{' (busy machine: timings noisy)' if load[0] > 4 else ''}")
    print(f"{'operation':<50}{'median s':>10}  [min, max]")
    for op in OPS + NEW_OPS + RESTART_OPS:
        print(_row(op, times[op]))

    def ratio(a: str, b: str) -> str:
        return f"{med[a] / med[b]:.2f}x" if a in med and b in med else "n/a"
    per_step = med["steps"] / args.steps
    print(f"memory save blocks / durable sync save: {med['memory save blocks'] / med['durable sync save']:.1%} "
          f"(target <= 5%)")
    print(f"memory commit R=1 / R=0: {ratio('memory commit R=1', 'memory commit R=0')} (target <= 1.5x); "
          f"the floor on one host, (R=0 + replica floor) / R=0: "
          f"{(med['memory commit R=0'] + med['replica floor']) / med['memory commit R=0']:.2f}x")
    print(f"steps during the R=1 save / steps: {ratio('steps during R=1 save', 'steps')} (target <= 1.1x; "
          f"{per_step:.3f} s a step)")
    print(f"load from peer / local memory: {ratio('load from peer', 'load local memory')} (target <= 1.5x); "
          f"local disk / local memory: {ratio('load local disk', 'load local memory')}")
    print(f"NVIDIA save R=2 / memory commit R=1: {ratio('NVIDIA save R=2 (clique)', 'memory commit R=1')} "
          f"(target >= 2x); local memory load / NVIDIA load: {ratio('load local memory', 'NVIDIA load')} "
          f"(target <= 1x)")
    print(f"S3 load / local memory load: {ratio('load S3 (zeroshard)', 'load local memory')}, "
          f"S3 load / peer load: {ratio('load S3 (zeroshard)', 'load from peer')} (target >= 5x)")
    print(f"new world: resharded from surviving memory / same-world-size memory load: "
          f"{ratio(NEW_OPS[0], NEW_OPS[1])} (target <= 2x)")
    for rank, ops in enumerate(result.get("timelines") or []):
        for name, timeline in ops.items():
            print(f"\n[timeline: {name}, rank {rank}]\n{timeline['text']}")


if __name__ == "__main__":
    main()
