"""Engine checkpoint benchmark: zeroshard save / load / async save vs raw disk I/O vs tuned FSDP2 + DCP.

    python tools/bench_checkpoint.py                 # small GPT (3.7M params), 2 ranks, ~3 min
    python tools/bench_checkpoint.py --n-layer 12 --n-embd 768 --vocab 50304   # GPT-2 small (124M)

One `torchrun --nproc-per-node 2` (gloo, CPU; `--device cuda`: NCCL, state on the GPUs) runs this
file with `--worker`. Each rank holds a
zeroshard engine (ZeRO stage 3) and a PyTorch FSDP2 model (`fully_shard` per Block, then the
root) of the same GPT, each with Adam state from one step. Then --repeats times (after --warmup
repeats that are dropped), interleaved through tools/benchlib.py's rotation, every side runs once:

  raw write / raw read   this rank's zeroshard file size, one unbuffered write + fsync / readinto
  zeroshard save / load  engine.save_checkpoint (sync, fsyncs) / engine.load_checkpoint
  DCP save / load        get_state_dict + dcp.save(FileSystemWriter(thread_count=T)) / dcp.load +
                         set_state_dict. T is TUNED first: thread_count 1, 2 and 4 each save
                         --tune-runs times and the lowest median is kept (DCP's docs: more
                         threads for more write parallelism)
  zeroshard async        save_checkpoint(async_save=True): blocked seconds + the copy-on-write the
                         next optimizer step pays at once (worst case), measured separately
  DCP async, thread      dcp.async_save with ONE FileSystemWriter and ONE DefaultStager reused for
                         every save: the stager keeps its staging buffers (what DCP's recipe gets
                         from cache_staged_state_dict=True, which on CPU fails: it pins memory)
  DCP async, process     dcp.async_save with a reused DefaultStager(use_async_staging=True,
                         shared memory) and AsyncCheckpointerType.PROCESS (a separate writer
                         process); blocked = return + staging completion (before the next step).
                         On CUDA both stagers are new for every save: a reused one fails its second
                         save there (torch 2.11, KeyError in deepcopy_with_tensor_offload)
  training loop          --loop-steps steps of each model with no save, and the same loop with an
                         async save issued after the first quarter (zeroshard; DCP thread-async):
                         what the background write costs the steps that run beside it: the
                         whole loop's ratio (diluted by the steps after the write), and the ratio
                         of only the steps that started while the write was in flight
  slow storage           with --slow-fsync S: an async save while every os.fsync in the ranks first
                         sleeps S seconds (injected here, never in the product); blocked must not grow
  cold reads             with --cold (default on when the page cache can be dropped, i.e. root),
                         raw read, zeroshard load and DCP load again right after dropping it;
                         when a drop fails (sync or the write), no cold row is recorded

Every timing is the slowest rank's seconds (barrier-aligned start). Loads are checked: state is
perturbed before, compared (checksums of master fragments and Adam moments) after. Figures are
medians of PAIRED ratios (each repeat's ratio of two runs that ran next to each other), with IQR,
written with the raw seconds to tools/results/bench_checkpoint.json (--json PATH elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))
import benchlib  # noqa: E402

GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (world size)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo on CPU ranks; cuda: NCCL, one GPU per rank (LOCAL_RANK), model state on the GPU")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="zeroshard ZeRO stage")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=256, help="model context (position embedding rows)")
    p.add_argument("--seq", type=int, default=32, help="sequence length of a training step")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank in a training step")
    p.add_argument("--repeats", type=int, default=10, help="measured repeats (each runs every side once)")
    p.add_argument("--warmup", type=int, default=1, help="repeats run first and dropped")
    p.add_argument("--tune-runs", type=int, default=3, help="saves per DCP thread_count while tuning it")
    p.add_argument("--loop-steps", type=int, default=12, help="steps of the training-loop sides (0: skip)")
    p.add_argument("--slow-fsync", type=float, default=0.0,
                   help="also time an async save with every fsync first sleeping this many seconds (slow "
                        "storage, injected in the bench's processes only); blocked time must not grow (0: skip)")
    p.add_argument("--no-dcp", action="store_true", help="skip the FSDP2 + DCP peer")
    p.add_argument("--no-dcp-process", action="store_true", help="skip DCP's process-based async checkpointer")
    p.add_argument("--cold", choices=["auto", "yes", "no"], default="auto",
                   help="also read after dropping the page cache (auto: when /proc/sys/vm/drop_caches is writable)")
    p.add_argument("--scratch", default=None, help="parent folder for the scratch dir (default: /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch dir")
    p.add_argument("--profile", action="store_true",
                   help="cProfile one extra zeroshard save and load on rank 0, then a per-thread timeline of one more "
                        "of each (tools/thread_timeline.py)")
    p.add_argument("--json", default=None, help="result file (default tools/results/bench_checkpoint.json)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds for the torchrun launch")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--can-drop", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker (one rank)

def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def fsync_dir(path: Path) -> None:
    """Commit pending unlinks now, so they are not paid inside the next timed operation."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(path: Path, data) -> None:
    """The baseline: plain Python, one unbuffered write of a tensor's bytes, then fsync."""
    view = memoryview(data.numpy())
    with open(path, "wb", buffering=0) as f:
        while view:
            n = f.write(view)
            view = view[n:]
        os.fsync(f.fileno())


def raw_read(path: Path, data) -> int:
    """Read the file back into a preallocated tensor (readinto: no extra copy)."""
    view = memoryview(data.numpy())
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return got


def worker(args: argparse.Namespace) -> None:  # noqa: C901  (one rank's whole run, read top to bottom)
    import torch
    import torch.distributed as dist

    import zeroshard
    from samples.gpt import GPT, GPTConfig, lm_loss

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    scratch = Path(args.dir)
    mine = scratch / f"raw-rank{rank}.bin"
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    runs: dict[str, list[float]] = {}
    nbytes: dict[str, int] = {}
    tuning: dict = {}

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[bench rank0 {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)  # NCCL reduces device tensors
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def total(n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        return int(t.item())

    def sync() -> None:  # CUDA work is asynchronous: an operation's time ends when its kernels do
        if cuda:
            torch.cuda.synchronize(device)

    def timed(fn) -> tuple[float, object]:
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return slowest(time.perf_counter() - t0), out

    def record(op: str, seconds: float, n: int | None = None) -> None:
        runs.setdefault(op, []).append(seconds)
        if n is not None:
            nbytes[op] = n

    def rm(path: Path) -> None:
        """Delete the previous output right before the next write (every side recycles the same
        freed page-cache memory) and commit the unlinks, outside the timed region."""
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            fsync_dir(path.parent)
        dist.barrier()

    def drop_cache() -> bool:
        """Whether the page cache was dropped (rank 0 drops it, every rank learns the outcome):
        a cold row is recorded only after a drop that happened."""
        dist.barrier()
        ok = torch.tensor([int(benchlib.drop_caches()) if rank == 0 else 1], dtype=torch.int64, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    cold_failed: list[str] = []

    def cold_ok(op: str) -> bool:
        if drop_cache():
            return True
        cold_failed.append(op)
        return False

    # ---- zeroshard engine ------------------------------------------------------------------
    torch.manual_seed(1234)
    model = GPT(cfg)
    n_params = model.num_params()
    zcfg = {"zero_optimization": {"stage": args.stage,
                                  **({"stage3_unit_classes": ["Block"]} if args.stage == 3 else {})}}
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
                                  config=zcfg)
    del model

    def zs_step() -> None:
        engine.backward(lm_loss(engine(x), y))
        engine.step()

    zs_step()
    log(f"{n_params / 1e6:.1f}M params; zeroshard stage {args.stage} engine + 1 Adam step")

    def zs_tensors():
        for _, info in engine.named_shards():
            yield info.fragment
            for v in info.optimizer_state.values():
                if torch.is_tensor(v) and v.dim() >= 1:
                    yield v[: info.end - info.start]

    def zs_checksum() -> float:
        return float(sum(t.double().sum().item() + t.double().abs().sum().item() for t in zs_tensors()))

    # ---- FSDP2 peer, DCP tuned as its docs recommend ------------------------------------------
    fsdp = opt = None
    if not args.no_dcp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(1234)
        fsdp = GPT(cfg)
        mesh = init_device_mesh(device.type, (world,))  # fully_shard moves the model onto the mesh's device
        for block in fsdp.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(fsdp, mesh=mesh)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-4)

        def fsdp_step() -> None:
            lm_loss(fsdp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        fsdp_step()
        gc.collect()

        def dcp_tensors():
            for p in fsdp.parameters():
                yield p.to_local()
                for v in opt.state[p].values():
                    if torch.is_tensor(v) and v.dim() >= 1:
                        yield v.to_local() if hasattr(v, "to_local") else v

        def dcp_checksum() -> float:
            return float(sum(t.double().sum().item() + t.double().abs().sum().item() for t in dcp_tensors()))

        def dcp_state() -> dict:
            msd, osd = get_state_dict(fsdp, opt)
            return {"model": msd, "optim": osd}

        threads = {"n": 1}

        def dcp_save(path: Path) -> None:
            dcp.save(dcp_state(), storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads["n"]))

        def dcp_load(path: Path) -> None:
            state = dcp_state()
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
            set_state_dict(fsdp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

        # tune thread_count: the lowest median of --tune-runs saves each (slowest rank's seconds)
        for n in (1, 2, 4):
            threads["n"] = n
            times = []
            for i in range(args.tune_runs):
                rm(scratch / "tune")
                times.append(timed(lambda: dcp_save(scratch / "tune"))[0])
            tuning[f"thread_count={n}"] = times
        rm(scratch / "tune")
        threads["n"] = min((1, 2, 4), key=lambda n: benchlib.quantile(tuning[f"thread_count={n}"], 0.5))
        tuning["chosen_thread_count"] = threads["n"]
        log(f"DCP thread_count tuned: {threads['n']} ({tuning})")
        # one writer and one stager for every async save, the stager caching its staging buffers
        # (DCP's async recipe says cache_staged_state_dict=True, but on CPU that pins memory and
        # fails without an accelerator; a reused DefaultStager caches the same way, unpinned)
        # async saves run collectives from a background thread: on their own group, as DCP's
        # async users do, so they cannot interleave with the training step's all-gathers
        ckpt_group = dist.new_group(backend="gloo")
        async_writer = dcp.FileSystemWriter(str(scratch / "dcp-async"), thread_count=threads["n"])
        # (on CUDA the process stager gets pinned buffers and non-blocking copies, DCP's recipe there;
        # the thread stager stays unpinned: torch 2.11's pinned DefaultStager, reused, fails its second
        # save with KeyError: <class 'type'> in _state_dict_stager.deepcopy_with_tensor_offload)
        def new_thread_stager():
            return DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                use_async_staging=False, use_non_blocking_copy=False))
        thread_stager = new_thread_stager()

        def new_process_stager():
            return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                use_async_staging=True, use_non_blocking_copy=cuda))
        stager = None if args.no_dcp_process else new_process_stager()

        def per_save(new, kept):  # on CUDA a reused DefaultStager fails its second save (torch 2.11:
            return new() if cuda else kept  # unpinned on an H100, pinned on an H200): a fresh one there
        process_writer = dcp.FileSystemWriter(str(scratch / "dcp-proc"), thread_count=threads["n"])

    # ---- the sides ----------------------------------------------------------------------------
    zs_root = scratch / "zs"
    raw = None
    saved: dict[str, float] = {}

    def zs_save(rep: int) -> None:
        nonlocal raw
        rm(zs_root / "sync")
        dt, _ = timed(lambda: engine.save_checkpoint(str(zs_root), tag="sync"))
        record("zs_save", dt, dir_bytes(zs_root / "sync"))
        saved["zs"] = zs_checksum()  # what zs_load must restore (training loops change state in between)
        if raw is None:  # the raw baseline writes as many bytes as this rank's file, random
            from zeroshard.format.manifest import rank_file_name

            size = (zs_root / "sync" / rank_file_name(rank, world)).stat().st_size
            raw = torch.empty(size // 4 + 1, dtype=torch.float32).normal_().view(torch.uint8)[:size]

    def raw_save(rep: int) -> None:
        if mine.exists():
            mine.unlink()
            fsync_dir(scratch)
        dt, _ = timed(lambda: raw_write(mine, raw))
        record("raw_write", dt, total(raw.numel()))

    def dcp_save_op(rep: int) -> None:
        rm(scratch / "dcp")
        dt, _ = timed(lambda: dcp_save(scratch / "dcp"))
        record("dcp_save", dt, dir_bytes(scratch / "dcp"))
        saved["dcp"] = dcp_checksum()

    def zs_async(rep: int) -> None:
        rm(zs_root / "async")
        blocked, _ = timed(lambda: engine.save_checkpoint(str(zs_root), tag="async", async_save=True))
        t0 = time.perf_counter()
        engine.checkpointer.before_state_change()  # what a step issued at once copies (worst case)
        sync()
        record("zs_async_cow", slowest(time.perf_counter() - t0))
        engine.wait()
        record("zs_async_blocked", blocked)

    def zs_async_slow_fsync(rep: int) -> None:
        rm(zs_root / "slow")
        real_fsync = os.fsync

        def slow_fsync(fd: int) -> None:
            time.sleep(args.slow_fsync)
            real_fsync(fd)

        os.fsync = slow_fsync
        try:
            blocked, _ = timed(lambda: engine.save_checkpoint(str(zs_root), tag="slow", async_save=True))
            engine.wait()
        finally:
            os.fsync = real_fsync
        record("zs_async_slow_blocked", blocked)

    def dcp_async_thread(rep: int) -> None:
        rm(scratch / "dcp-async")
        blocked, fut = timed(lambda: dcp.async_save(dcp_state(), checkpoint_id=str(scratch / "dcp-async"),
                                                    storage_writer=async_writer,
                                                    async_stager=per_save(new_thread_stager, thread_stager),
                                                    process_group=ckpt_group))
        fut.result()
        record("dcp_async_thread_blocked", blocked)

    def dcp_async_process(rep: int) -> None:
        rm(scratch / "dcp-proc")

        def start():
            resp = dcp.async_save(dcp_state(), checkpoint_id=str(scratch / "dcp-proc"), storage_writer=process_writer,
                                  async_stager=per_save(new_process_stager, stager),
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  process_group=ckpt_group)  # NCCL's default group has no CPU backend
            if isinstance(resp, AsyncSaveResponse):  # the next step may change state once staged
                resp.staging_completion.result()
                return resp.upload_completion
            return resp

        blocked, fut = timed(start)
        fut.result()
        record("dcp_async_process_blocked", blocked)

    step_times: dict[str, list[list[float]]] = {}  # per loop side, per repeat: each step's seconds
    overlapped: dict[str, list[list[int]]] = {}  # per save loop, per repeat: the steps beside the write

    def loop(name: str, step, save, old: Path | None = None) -> float:
        """--loop-steps steps; `save` (if any) issued after the first quarter; the write may still
        run in the background when the loop ends (then every later step overlapped it). Each
        step's own seconds are kept, and which steps started while the write was in flight on
        any rank, so the steps beside the write can be reported on their own."""
        if old is not None:
            rm(old)
        dist.barrier()
        t0 = time.perf_counter()
        pending = None
        times, flying = [], []
        for i in range(args.loop_steps):
            if save is not None and i == args.loop_steps // 4:
                pending = save()
            s0 = time.perf_counter()
            flying.append(int(pending is not None and not pending[1]()))
            step()
            sync()  # a step's time ends when its kernels do
            times.append(time.perf_counter() - s0)
        seconds = slowest(time.perf_counter() - t0)
        if pending is not None:
            pending[0]()
        # one collective after the loop, not one per step: the slowest rank's step, any rank's write
        t = torch.tensor(times + flying, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        step_times.setdefault(name, []).append(t[:len(times)].tolist())
        if save is not None:
            overlapped.setdefault(name, []).append([i for i, f in enumerate(t[len(times):].tolist()) if f])
        return seconds

    def zs_loop_save():
        """(wait, done): done says whether this rank's background write has finished."""
        engine.save_checkpoint(str(zs_root), tag="loop", async_save=True)
        ckpt = engine.checkpointer
        return engine.wait, lambda: ckpt._thread is None or not ckpt._thread.is_alive()  # a bench may peek

    def dcp_loop_save():
        fut = dcp.async_save(dcp_state(), checkpoint_id=str(scratch / "dcp-loop"), storage_writer=async_writer,
                             async_stager=per_save(new_thread_stager, thread_stager), process_group=ckpt_group)
        return fut.result, fut.done

    def raw_load(rep: int, cold: bool = False) -> None:
        if cold and not cold_ok("raw_read"):
            return
        dt, got = timed(lambda: raw_read(mine, raw))
        assert got == raw.numel(), (got, raw.numel())
        record("raw_read_cold" if cold else "raw_read", dt, total(got))

    def zs_load(rep: int, cold: bool = False) -> None:
        want = saved["zs"]
        with torch.no_grad():
            for t in zs_tensors():
                t.add_(1.0)  # so that a load that does nothing cannot pass the check
        if cold and not cold_ok("zs_load"):
            return
        dt, _ = timed(lambda: engine.load_checkpoint(str(zs_root / "sync")))
        got = zs_checksum()
        if abs(got - want) > 1e-6 * max(1.0, abs(want)):
            raise SystemExit(f"rank {rank}: zeroshard load mismatch: checksum {got} != {want}")
        record("zs_load_cold" if cold else "zs_load", dt, dir_bytes(zs_root / "sync"))

    def dcp_load_op(rep: int, cold: bool = False) -> None:
        want = saved["dcp"]
        with torch.no_grad():
            for t in dcp_tensors():
                t.add_(1.0)
        if cold and not cold_ok("dcp_load"):
            return
        dt, _ = timed(lambda: dcp_load(scratch / "dcp"))
        got = dcp_checksum()
        if abs(got - want) > 1e-6 * max(1.0, abs(want)):
            raise SystemExit(f"rank {rank}: DCP load mismatch: checksum {got} != {want}")
        record("dcp_load_cold" if cold else "dcp_load", dt, dir_bytes(scratch / "dcp"))

    has_dcp = fsdp is not None
    writes = [zs_save, raw_save] + ([dcp_save_op] if has_dcp else [])
    asyncs = [zs_async] + ([dcp_async_thread] if has_dcp else []) + \
        ([dcp_async_process] if has_dcp and stager is not None else []) + \
        ([zs_async_slow_fsync] if args.slow_fsync > 0 else [])
    loops = []
    if args.loop_steps:
        loops = [lambda rep: record("loop_zs_plain", loop("loop_zs_plain", zs_step, None)),
                 lambda rep: record("loop_zs_async", loop("loop_zs_async", zs_step, zs_loop_save, zs_root / "loop"))]
        if has_dcp:
            loops += [lambda rep: record("loop_fsdp_plain", loop("loop_fsdp_plain", fsdp_step, None)),
                      lambda rep: record("loop_fsdp_dcp_async",
                                         loop("loop_fsdp_dcp_async", fsdp_step, dcp_loop_save, scratch / "dcp-loop"))]
    reads = [raw_load, zs_load] + ([dcp_load_op] if has_dcp else [])
    cold = args.can_drop
    for rep in range(args.warmup + args.repeats):
        for group in (writes, asyncs, loops, reads):
            for op in benchlib.rotated(group, rep):
                if rep == 0:
                    log(f"first run of {getattr(op, '__name__', 'a loop')}")
                op(rep)  # rep 0 starts with zs_save: its rank-file size sets the raw baseline's bytes
        if cold:
            for op in benchlib.rotated(reads, rep):
                op(rep, cold=True)
        log(f"repeat {rep + 1}/{args.warmup + args.repeats} done" + (" (warm-up)" if rep < args.warmup else ""))
    for s in ((thread_stager, stager) if has_dcp else ()):
        if s is not None:
            s.close()

    profile = _profile(engine, zs_root, rank, dist) if args.profile else None
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "n_params": n_params, "world_size": world, "stage": args.stage, "runs": runs, "bytes": nbytes,
            "dcp_tuning": tuning, "profile": profile, "step_times": step_times, "overlapped": overlapped,
            "cold_failed": cold_failed,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu"}))
    dist.barrier()
    dist.destroy_process_group()


def _profile(engine, zs_root: Path, rank: int, dist) -> dict:
    """cProfile one more save and load on rank 0 (every rank runs them; rank 0 is profiled)."""
    import cProfile
    import io
    import pstats

    def run(op: str, tag: str) -> None:
        if op == "save":
            engine.save_checkpoint(str(zs_root), tag=tag)
        else:
            engine.load_checkpoint(str(zs_root / tag))

    out = {}
    for op in ("save", "load"):
        prof = cProfile.Profile()
        dist.barrier()
        if rank == 0:
            prof.enable()
        run(op, "profile")
        if rank == 0:
            prof.disable()
            s = io.StringIO()
            for order, lines in (("tottime", 12), ("cumulative", 30)):  # where time is spent, and on whose behalf
                pstats.Stats(prof, stream=s).sort_stats(order).print_stats(lines)
            out[op] = s.getvalue()
    # cProfile sees only the calling thread: a sampled per-thread timeline shows what the
    # background threads (write-behind, hash-behind, read-ahead) do at the same time.
    from thread_timeline import ThreadTimeline

    for op in ("save", "load"):
        dist.barrier()
        with ThreadTimeline() as timeline:
            run(op, "timeline")
        if rank == 0:
            out[f"{op}_timeline"] = timeline.summary()
            out[f"{op}_timeline_text"] = timeline.report()
    dist.barrier()
    return out


# ----------------------------------------------------------------------------- parent

def launch(args: argparse.Namespace, scratch: Path, can_drop: bool) -> dict:
    out = scratch / "result.json"
    forward = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
               if k in ("device", "stage", "n_layer", "n_embd", "n_head", "vocab", "block_size", "seq", "batch",
                        "repeats", "warmup", "tune_runs", "loop_steps", "slow_fsync")]
    forward += [f"--{k.replace('_', '-')}" for k in ("no_dcp", "no_dcp_process", "profile") if getattr(args, k)]
    forward += ["--can-drop"] if can_drop else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(Path(__file__).resolve()), "--worker", "--dir", str(scratch), "--out", str(out), *forward]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        r = subprocess.run(cmd, env=env, timeout=args.timeout, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout}s"}
    if r.returncode != 0 or not out.exists():
        lines = r.stderr.strip().splitlines()
        ranked = [ln for ln in lines if ln.startswith("[rank")]  # the ranks' own tracebacks
        return {"error": f"exit {r.returncode}", "log_tail": "\n".join((ranked or lines)[-30:])}
    return json.loads(out.read_text())


LABELS = {
    "raw_write": "raw write + fsync (per rank)", "zs_save": "zeroshard save (sync)",
    "dcp_save": "DCP save (tuned thread_count)", "raw_read": "raw read (warm cache)",
    "zs_load": "zeroshard load (warm cache)", "dcp_load": "DCP load (warm cache)",
    "raw_read_cold": "raw read (cold cache)", "zs_load_cold": "zeroshard load (cold cache)",
    "dcp_load_cold": "DCP load (cold cache)", "zs_async_blocked": "zeroshard async: blocked",
    "zs_async_cow": "zeroshard async: copy-on-write of the next step",
    "zs_async_slow_blocked": "zeroshard async, every fsync slowed (--slow-fsync): blocked",
    "dcp_async_thread_blocked": "DCP async, thread, reused writer + cached staging: blocked",
    "dcp_async_process_blocked": "DCP async, process + async staging: blocked until staged",
    "loop_zs_plain": "zeroshard: loop without save", "loop_zs_async": "zeroshard: loop with async save",
    "loop_fsdp_plain": "FSDP2: loop without save", "loop_fsdp_dcp_async": "FSDP2: loop with DCP async save",
}


def overlap_runs(res: dict, save: str, plain: str, warmup: int) -> tuple[list[float], list[float], list[int]]:
    """Per measured repeat with a step beside the write: the seconds of those steps in the save
    loop, and of the same steps (by index) in the same repeat's loop without a save; and how many
    steps overlapped in every measured repeat. A loop's total dilutes the write's cost over the
    steps that ran after it finished; these are the steps it can slow down."""
    steps, flying = res.get("step_times", {}), res.get("overlapped", {})
    if save not in flying or plain not in steps:
        return [], [], []
    with_save, without, counts = [], [], []
    for idx, s_times, p_times in list(zip(flying[save], steps[save], steps[plain]))[warmup:]:
        counts.append(len(idx))
        if idx:
            with_save.append(sum(s_times[i] for i in idx))
            without.append(sum(p_times[i] for i in idx))
    return with_save, without, counts


def build_report(res: dict, args: argparse.Namespace, cache: str) -> benchlib.Report:
    w = args.warmup
    runs = {k: v[w:] for k, v in res["runs"].items()}
    failed = res.get("cold_failed") or []
    if failed:  # a row after a drop that did not happen would be a warm read labelled cold
        runs = {k: v for k, v in runs.items() if not k.endswith("_cold")}
        cache = "warm (cold rows not measured: the page-cache drop failed)"
    where = (f"CUDA ({res.get('device')}), NCCL" if args.device == "cuda" else "CPU, gloo")
    state = "state in GPU memory, local disk" if args.device == "cuda" else \
        "state in host memory, write-cached virtual disk"
    scope = (f"{where}, world {res['world_size']}, {benchlib.machine()['cores']} vCPUs, GPT {args.n_layer}L/"
             f"{args.n_embd}d vocab {args.vocab} = {res['n_params'] / 1e6:.1f}M params + Adam fp32, stage "
             f"{res['stage']}, {state}")
    rep = benchlib.Report("bench_checkpoint", vars(args), scope, cache=cache)
    for k, label in LABELS.items():
        if k in runs:
            rep.runs(k, runs[k], label)
    b = res["bytes"]

    def throughput(a: str, base: str) -> list[float]:  # (bytes/s of a) / (bytes/s of base), per repeat
        return [(b[a] / ta) / (b[base] / tb) for ta, tb in zip(runs[a], runs[base])]

    rep.ratio_values("save_vs_raw", throughput("zs_save", "raw_write"), "zeroshard save / raw write throughput",
                     ">= 0.8")
    rep.ratio_values("load_vs_raw", throughput("zs_load", "raw_read"), "zeroshard load / raw read throughput, warm",
                     ">= 0.8")
    if "zs_load_cold" in runs:
        rep.ratio_values("load_vs_raw_cold", throughput("zs_load_cold", "raw_read_cold"),
                         "zeroshard load / raw read throughput, cold")
    cost = [bl + cw for bl, cw in zip(runs["zs_async_blocked"], runs["zs_async_cow"])]
    rep.ratio_values("async_cost_vs_sync", benchlib.paired_ratios(cost, runs["zs_save"]),
                     "zeroshard async: (blocked + copy-on-write) / sync save", "<= 0.10",
                     percent=True)
    if "loop_zs_plain" in runs:
        rep.ratio("loop_slowdown", "loop_zs_async", "loop_zs_plain",
                  f"zeroshard: {args.loop_steps} steps with an async save / without (diluted: the steps after "
                  f"the write count too)")
    for save, plain, who in (("loop_zs_async", "loop_zs_plain", "zeroshard"),
                             ("loop_fsdp_dcp_async", "loop_fsdp_plain", "FSDP2 + DCP")):
        with_save, without, counts = overlap_runs(res, save, plain, w)
        if counts:
            rep.data.setdefault("overlap_steps", {})[save] = counts
        if len(with_save) >= 2:
            rep.runs(f"{save}_overlap", with_save, f"{who}: the steps beside the write, with the save")
            rep.runs(f"{plain}_overlap", without, f"{who}: the same steps, without a save")
            rep.ratio(f"{save}_overlap_slowdown", f"{save}_overlap", f"{plain}_overlap",
                      f"{who}: steps beside the write / the same steps without a save",
                      "<= 1.05" if who == "zeroshard" else None)
        elif counts:
            rep.note(f"{who}: the steps beside the write were not measured: only {len(with_save)} of "
                     f"{len(counts)} repeats had a step start while the write was in flight.")
    if "dcp_save" in runs:
        rep.ratio("save_vs_dcp", "zs_save", "dcp_save", "DCP save time / zeroshard save time", ">= 1.5", invert=True)
        rep.ratio("load_vs_dcp", "zs_load", "dcp_load", "DCP load time / zeroshard load time", ">= 1.5", invert=True)
        if "zs_load_cold" in runs:
            rep.ratio("load_vs_dcp_cold", "zs_load_cold", "dcp_load_cold", "DCP / zeroshard load time, cold",
                      invert=True)
        for kind in ("thread", "process"):
            key = f"dcp_async_{kind}_blocked"
            if key in runs:
                rep.ratio_values(f"async_vs_dcp_{kind}", benchlib.paired_ratios(runs[key], cost),
                                 f"DCP async ({kind}) blocked / zeroshard blocked + copy-on-write", ">= 1.5")
        if "loop_fsdp_plain" in runs:
            rep.ratio("loop_slowdown_dcp", "loop_fsdp_dcp_async", "loop_fsdp_plain",
                      f"FSDP2: {args.loop_steps} steps with a DCP async save / without")
    tuning = res.get("dcp_tuning") or {}
    if tuning:
        rep.data["dcp_tuning"] = tuning
        rep.note(f"DCP tuned: FileSystemWriter thread_count in (1, 2, 4), {args.tune_runs} saves each, lowest "
                 f"median kept: {tuning['chosen_thread_count']}. Async thread: one FileSystemWriter and one "
                 f"DefaultStager (caches its staging buffers; cache_staged_state_dict=True pins memory, which "
                 f"fails on a CPU-only machine) reused for every save. Async process: "
                 f"AsyncCheckpointerType.PROCESS with a DefaultStager(use_async_staging=True, "
                 f"use_shared_memory=True"
                 + ("; pinned memory and non-blocking copies: CUDA). On CUDA both stagers are NEW for every "
                    "save (pinned buffers allocated each time): torch's DefaultStager fails its second save "
                    "there (KeyError: <class 'type'> in deepcopy_with_tensor_offload)." if args.device == "cuda"
                    else "; pinned memory off: CPU) reused for every save."))
    if failed:
        rep.note(f"Cold rows not measured: the page-cache drop failed {len(failed)} times "
                 f"(before {', '.join(sorted(set(failed)))}).")
    rep.data["bytes"] = b
    rep.data["n_params"] = res["n_params"]
    if res.get("profile"):
        rep.data["profile"] = res["profile"]
        for op in ("save", "load"):
            print(f"\n[timeline of one {op}, rank 0]\n{res['profile'][f'{op}_timeline_text']}")
    return rep


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    can_drop = args.cold == "yes" or (args.cold == "auto" and os.access("/proc/sys/vm/drop_caches", os.W_OK))
    scratch = Path(tempfile.mkdtemp(prefix="zs-bench-ckpt-", dir=args.scratch))
    print(f"[bench] scratch dir {scratch}; load average {benchlib.loadavg()}", flush=True)
    load_before = benchlib.loadavg()
    try:
        res = launch(args, scratch, can_drop)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    if "error" in res:
        print(f"[bench] FAILED ({res['error']})\n{res.get('log_tail', '')}", flush=True)
        return 1
    rep = build_report(res, args, "warm, and cold (page cache dropped) rows" if can_drop else "warm")
    rep.data["load_before"] = load_before
    path = rep.finish(args.json)
    print("\n" + rep.table())
    for n in rep.data["notes"]:
        print("\n" + n)
    print(f"\nraw JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
