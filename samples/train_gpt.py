"""Train the sample character-level GPT with zeroshard (ZeRO stages 0-3) on CPU ranks (or GPUs).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 samples/train_gpt.py --stage 2 --steps 100
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 samples/train_gpt.py --stage 3 --ckpt runs/gpt
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 samples/train_gpt.py --stage 3 --ckpt runs/gpt \
        --resume --steps 200      # continue (at another world size if you like) to step 200

On GPUs add `--device cuda` (NCCL, one GPU per rank). `--steps` is the total number of optimizer
steps; a resumed run continues from the step saved in the checkpoint (`--resume` alone: the
latest in --ckpt; `--resume PATH`: that checkpoint). Data depends only on (seed, step, --batch,
--block-size), never on the world size or --grad-accum, so a resumed run sees the same stream of
batches.

With --ckpt DIR the script writes DIR/model_config.json (model config + vocabulary, for
samples/generate.py) and calls engine.save_checkpoint(DIR, client_state=...) every
--save-every steps and at the end. Run without torchrun for a single process.

With --memory-every N it checkpoints through the memory tier instead (docs/RECOVERY.md): a
checkpoint in each node's /dev/shm every N steps with a copy on another node, drained to DIR
every --save-every steps, and --resume takes the newest complete copy, memory first:

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 samples/train_gpt.py --ckpt runs/gpt \
        --memory-every 5 --save-every 50 --steps 200 [--resume]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `samples` package

from samples.data import BatchSampler, get_batch, load_dataset  # noqa: E402
from samples.gpt import GPT, GPTConfig, lm_loss  # noqa: E402

MODEL_CONFIG_FILE = "model_config.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo on CPU ranks; cuda: NCCL, one GPU per rank (torchrun's LOCAL_RANK)")
    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps (including resumed ones)")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences per optimizer step)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--ckpt", type=str, default=None, help="checkpoint directory")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--memory-every", type=int, default=0,
                   help="with --ckpt: a memory-tier checkpoint every N steps (docs/RECOVERY.md), drained "
                        "to --ckpt every --save-every steps; 0: no memory tier")
    p.add_argument("--memory-dir", default=None,
                   help="the memory tier's root (default /dev/shm/zeroshard-<job>; the job is --ckpt's path)")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="PATH",
                   help="continue from the latest checkpoint in --ckpt, or from PATH (a checkpoint "
                        "root or one tagged checkpoint folder, e.g. DIR/step-00000100)")
    p.add_argument("--export", type=str, default=None, metavar="FILE.safetensors",
                   help="at the end, write the full fp32 weights (engine.full_state_dict()) to this "
                        "file, with model_config.json beside it, for samples/generate.py")
    p.add_argument("--seed", type=int, default=1337, help="seeds model init and the data stream")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches at the end (0: none)")
    args = p.parse_args(argv)
    if args.resume is True and not args.ckpt:
        p.error("--resume without PATH needs --ckpt DIR")
    if args.memory_every and not args.ckpt:
        p.error("--memory-every needs --ckpt DIR (the durable root it drains to)")
    return args


def init_distributed(backend: str = "gloo") -> None:
    """Join the torchrun process group; a plain `python` run becomes a 1-rank group."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":  # one GPU per rank, before the group binds to a device
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend)


def engine_config(args: argparse.Namespace) -> dict:
    return {
        # stage 3 gathers one transformer Block at a time (other modules: one unit each)
        "zero_optimization": {"stage": args.stage,
                              **({"stage3_unit_classes": ["Block"]} if args.stage == 3 else {})},
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16"},
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": args.grad_clip,
    }


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def format_memory(reports: list[dict]) -> str:
    """Every rank's engine.memory_report() in MiB: params/grads/optimizer = total (optimizer
    includes fp32 master weights; total also counts buffers and in-flight comm buffers)."""
    parts = []
    for r, m in enumerate(reports):
        parts.append(f"r{r} " + "/".join(mib(m.get(k, 0)) for k in ("params", "grads", "optimizer"))
                     + f"={mib(m.get('total', 0))}")
    return "mem MiB p/g/o=total: " + "  ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    init_distributed("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)

    import zeroshard  # after argument parsing, so --help works without the engine

    tok, train_ids, val_ids = load_dataset()
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)

    def write_model_config(directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        meta = directory / MODEL_CONFIG_FILE
        meta.write_text(json.dumps({"model": cfg.to_dict(), "vocab": tok.to_json()}, indent=1))

    ckpt_dir = Path(args.ckpt) if args.ckpt else None
    if ckpt_dir is not None and rank == 0:
        meta = ckpt_dir / MODEL_CONFIG_FILE
        if args.resume and meta.exists():
            saved = json.loads(meta.read_text())
            if saved.get("model") != cfg.to_dict() or saved.get("vocab") != tok.to_json():
                raise SystemExit(f"{meta} describes a different model or vocabulary than this run "
                                 f"(model flags: {saved.get('model')})")
        write_model_config(ckpt_dir)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    engine = zeroshard.initialize(model=model, optimizer=opt, config=engine_config(args))

    sampler = BatchSampler(train_ids, args.batch, args.block_size, seed=args.seed,
                           world_size=world, rank=rank, grad_accum=args.grad_accum)

    ckpt = None  # with --memory-every: a Checkpointer with the memory tier
    if args.memory_every:  # the job is named by its durable root, so a relaunch finds its memory copies
        ckpt = zeroshard.Checkpointer(engine, tiers=zeroshard.TierPolicy(
            job=str(ckpt_dir.resolve()), memory_dir=args.memory_dir, memory_every=args.memory_every,
            durable_every=args.save_every))
    can_save = hasattr(engine, "save_checkpoint")
    can_load = hasattr(engine, "load_checkpoint")
    if ckpt_dir is not None and not can_save:
        log("note: this zeroshard engine has no save_checkpoint(); --ckpt will only write "
            f"{ckpt_dir / MODEL_CONFIG_FILE}, no checkpoint")
    if args.resume:
        dist.barrier()  # rank 0 may just have created ckpt_dir
        source = ckpt_dir if args.resume is True else Path(args.resume)
        if not can_load:
            raise SystemExit("--resume: this zeroshard engine has no load_checkpoint() yet")
        has_files = source.is_dir() and any(p.name != MODEL_CONFIG_FILE for p in source.iterdir())
        if ckpt is not None:  # a memory copy may be all there is
            has_files = has_files or Path(ckpt.memory.path).is_dir()
        if not has_files and args.resume is not True:
            raise SystemExit(f"--resume {source}: no checkpoint there")
        if not has_files:
            log(f"--resume: no checkpoint in {source} yet, starting from step 0")
        else:
            if ckpt is not None:
                client_state = ckpt.load(str(source))
                log(ckpt.last_recovery)
            else:
                client_state = engine.load_checkpoint(str(source))
            if isinstance(client_state, tuple):  # DeepSpeed-style (path, client_state)
                client_state = client_state[-1]
            if not client_state or "data" not in client_state:
                raise SystemExit(f"--resume: checkpoint in {source} carries no data-loader state "
                                 "(was it written by this script?)")
            if client_state.get("model") not in (None, cfg.to_dict()):
                raise SystemExit(f"--resume: checkpoint model {client_state['model']} != this run's {cfg.to_dict()}")
            sampler.load_state_dict(client_state["data"])
            log(f"resumed from {source} at step {sampler.step} "
                f"(saved at world size {client_state.get('world_size', '?')}, now {world})")

    def state_to_save() -> dict:
        return {"data": sampler.state_dict(), "model": cfg.to_dict(), "vocab": tok.to_json(),
                "world_size": world, "args": vars(args)}

    def save() -> None:
        if ckpt_dir is None or not can_save:
            return
        t = time.perf_counter()
        if ckpt is not None:  # the last one: durable, now
            ckpt.wait()
            ckpt.save(str(ckpt_dir), client_state=state_to_save())
        else:
            engine.save_checkpoint(str(ckpt_dir), client_state=state_to_save())
        log(f"saved checkpoint at step {sampler.step} to {ckpt_dir} ({time.perf_counter() - t:.2f}s)")

    start_step = sampler.step
    tokens_per_step = args.batch * args.block_size
    log(f"zeroshard GPT: {model.num_params() / 1e6:.3f}M params, vocab {tok.vocab_size}, "
        f"world {world}, stage {args.stage}, {args.dtype}, batch {args.batch} x {args.block_size} tokens, "
        f"grad-accum {args.grad_accum}, steps {start_step}->{args.steps}")

    first_loss = last_loss = None
    step_times: list[float] = []
    zeros = lambda: torch.zeros((), device=engine.device)  # noqa: E731  (NCCL reduces GPU tensors)
    window_t0, window_steps, window_loss = time.perf_counter(), 0, zeros()
    t_train0 = time.perf_counter()
    while sampler.step < args.steps:
        step = sampler.step + 1  # the optimizer step this iteration completes
        logging = step % args.log_every == 0 or step == args.steps or step == start_step + 1
        t0 = time.perf_counter()
        micro_losses, mem = [], None
        for x, y in sampler.next_step():
            x, y = x.to(engine.device), y.to(engine.device)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            if logging:  # after the last backward: gradients and optimizer state both held
                mem = engine.memory_report()
            engine.step()  # steps the optimizer only at the accumulation boundary
            micro_losses.append(loss.detach().float())
        step_times.append(time.perf_counter() - t0)
        window_steps += 1
        window_loss += torch.stack(micro_losses).mean()

        if logging:  # loss: mean over ranks and over the steps since the last log line
            loss_t = window_loss / window_steps
            dist.all_reduce(loss_t)
            last_loss = loss_t.item() / world
            if first_loss is None:
                first_loss = last_loss
            reports = [None] * world
            dist.all_gather_object(reports, mem)
            elapsed = time.perf_counter() - window_t0
            log(f"step {step:5d} | loss {last_loss:.4f} | {window_steps * tokens_per_step / elapsed:8.0f} tok/s | "
                f"{format_memory(reports)}")
            window_t0, window_steps, window_loss = time.perf_counter(), 0, zeros()
        if ckpt is not None and step < args.steps:  # does what is due at this step, in the background
            ckpt.checkpoint(str(ckpt_dir), client_state=state_to_save())
        elif args.save_every and step % args.save_every == 0 and step < args.steps:
            save()
    train_s = time.perf_counter() - t_train0

    val_loss = None
    if args.eval_batches > 0:
        with torch.no_grad():
            total = zeros()
            for i in range(args.eval_batches):
                x, y = get_batch(val_ids, i, args.batch, args.block_size, seed=args.seed,
                                 world_size=world, rank=rank)
                x, y = x.to(engine.device), y.to(engine.device)
                total += lm_loss(engine(x), y).float()
            dist.all_reduce(total)
            val_loss = total.item() / (world * args.eval_batches)

    if sampler.step > start_step:
        save()
    if args.export:
        full = engine.full_state_dict()  # collective: every rank takes part, rank 0 gets the weights
        if rank == 0:
            from safetensors.torch import save_file

            out = Path(args.export)
            write_model_config(out.parent)
            save_file({k: v.detach().float().contiguous() for k, v in full.items()}, str(out))
            log(f"exported full weights ({len(full)} tensors) to {out}; sample with: "
                f"python samples/generate.py {out}")
    report = engine.memory_report()
    reports = [None] * world
    dist.all_gather_object(reports, report)
    steps_run = sampler.step - start_step
    if steps_run:
        med = statistics.median(step_times)
        log("-" * 72)
        log(f"done: steps {start_step}->{sampler.step} in {train_s:.1f}s | "
            f"median step {med * 1000:.1f} ms | {tokens_per_step / med:.0f} tok/s (median)")
        log(f"train loss {first_loss:.4f} (first logged) -> {last_loss:.4f} (last log window)"
            + (f" | val loss {val_loss:.4f}" if val_loss is not None else ""))
        log(f"world {world} | stage {args.stage} | {args.dtype} | at end: {format_memory(reports)}")
        if ckpt_dir is not None:
            log(f"checkpoint dir: {ckpt_dir} (model config + vocab: {ckpt_dir / MODEL_CONFIG_FILE})")
    else:
        log(f"nothing to do: already at step {sampler.step} >= --steps {args.steps}"
            + (f" | val loss {val_loss:.4f}" if val_loss is not None else ""))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
