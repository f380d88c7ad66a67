"""Reshard against the tools users run today: DeepSpeed's universal conversion, DCP's load-time resharding.

    python tools/bench_reshard.py                               # GPT 4L/512d (29M params), world 2 -> 3
    python tools/bench_reshard.py --n-layer 24 --n-embd 1536 --vocab 50304 --repeat 3   # ~0.75B params

Three torchrun launches (2 ranks, gloo, CPU) train the same sample GPT one AdamW step and save it
with its optimizer state: a zeroshard engine (stage 3), a DeepSpeed engine (ZeRO-3), and FSDP2
with DCP (`get_state_dict` + `dcp.save`). Then, interleaved (tools/benchlib.py: one warm-up, then
--repeat repeats):

Offline, each a fresh process (what a user runs before relaunching at another world size):
- zeroshard reshard CKPT --to 3 (rank files for 3 ranks, optimizer state included)
- DeepSpeed ds_to_universal (its documented way to change the world size of a ZeRO checkpoint:
  one file per parameter and state, which any world size loads); --num_extract_workers and
  --num_merge_workers are tuned first over (1, 1), (2, 1), (4, 2): the fastest of one run each
- baseline: `cp -r` of zeroshard's rank files + `sync` (the same bytes read and written)

At load time, torchrun at 3 ranks, the slowest rank's seconds from a barrier to loaded:
- zeroshard: Checkpointer load of the world-2 checkpoint into a stage-3 engine (each rank reads
  the ranges it now owns: zeroshard needs no offline step)
- DCP: dcp.load + set_state_dict into FSDP2 (model + AdamW) of the world-2 DCP checkpoint, the
  resharding DCP does at load time

Reported: median and IQR of the paired time ratios; peak RSS of the offline tools. Raw JSON:
tools/results/bench_reshard.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_gpt  # noqa: E402
import benchlib  # noqa: E402

from bench_toolkit import timed  # noqa: E402  (wall, child peak RSS, CPU)

NEW_WORLD = 3
WORKER_SETTINGS = [(1, 1), (2, 1), (4, 2)]  # ds_to_universal (extract, merge) workers tried


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from samples.gpt import lm_loss

    which = args.worker
    bench_gpt.init_group(deepspeed=which == "save-ds")
    model = bench_gpt.sample_gpt(args)
    x = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    if which in ("save-zs", "load-zs"):
        import zeroshard

        eng = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                   config={"zero_optimization": {"stage": 3}})
        ckpt = zeroshard.Checkpointer(eng)
        if which == "save-zs":
            eng.backward(lm_loss(eng(x), x))
            eng.step()
            ckpt.save(args.dir, tag="t")
        else:
            dist.barrier()
            start = time.perf_counter()
            ckpt.load(args.dir)
            dist.barrier()
            _report(args, time.perf_counter() - start, eng.global_steps == 1)
    elif which == "save-ds":
        bench_gpt.save_deepspeed(model, x, args.dir)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        fsdp, opt = bench_gpt.fully_shard_blocks(model)
        if which == "save-dcp":
            lm_loss(fsdp(x), x).backward()
            opt.step()
            msd, osd = get_state_dict(fsdp, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.dir)
        else:
            dist.barrier()
            start = time.perf_counter()
            msd, osd = get_state_dict(fsdp, opt)  # the state to load into, as DCP's docs do it
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=args.dir)
            set_state_dict(fsdp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            dist.barrier()
            steps = {int(s["step"]) for s in opt.state.values() if "step" in s}
            _report(args, time.perf_counter() - start, steps == {1})
    dist.barrier()
    dist.destroy_process_group()


def _report(args: argparse.Namespace, seconds: float, loaded: bool) -> None:
    """Rank 0 writes the load's seconds; a load that did not bring the step back is an error."""
    import torch.distributed as dist

    if not loaded:
        raise SystemExit(f"{args.worker}: the optimizer state did not come back (rank {dist.get_rank()})")
    if dist.get_rank() == 0:
        Path(args.time_file).write_text(f"{seconds}\n")


def launch(worker_name: str, folder: Path, args: argparse.Namespace, nproc: int, time_file: Path | None = None):
    extra = [] if time_file is None else ["--time-file", str(time_file)]
    bench_gpt.launch(__file__, ["--worker", worker_name, "--dir", str(folder), *bench_gpt.model_argv(args), *extra],
                     nproc, worker_name, timeout=1800)


def universal_params(folder: Path) -> set[str]:
    """Parameters the universal conversion wrote with their fp32 weights and both Adam moments."""
    zero = folder / "zero"
    return {p.name for p in zero.iterdir() if p.is_dir()
            and all((p / f).is_file() for f in ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt"))} if zero.is_dir() else set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_gpt.add_model_args(p)
    p.add_argument("--repeat", type=int, default=5, help="interleaved repeats after one warm-up")
    p.add_argument("--dir", default="/tmp/zs-bench-reshard")
    p.add_argument("--json", default=None, help="result file (default tools/results/bench_reshard.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--time-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for which in ("zs", "ds", "dcp"):
        launch(f"save-{which}", work / which, args, nproc=2)
    zs_ckpt, ds_ckpt = work / "zs" / "t", work / "ds" / "t"
    ckpt_bytes = sum(f.stat().st_size for f in zs_ckpt.iterdir())
    from zeroshard.format import open_checkpoint

    params = {name for name, t in open_checkpoint(str(work / "zs"))[1].tensors.items() if t.role == "param"}
    outs = {k: work / f"out-{k}" for k in ("zs", "ds", "cp")}
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

    def ds_command(extract: int, merge: int) -> list[str]:
        return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ds_ckpt),
                "--output_folder", str(outs["ds"]), "--num_extract_workers", str(extract),
                "--num_merge_workers", str(merge)]

    def clean(key: str) -> None:
        shutil.rmtree(outs.get(key, work / "none"), ignore_errors=True)
        subprocess.run("sync", shell=True)

    os.environ.update(env)
    tuning = {}
    for setting in WORKER_SETTINGS:  # DeepSpeed's workers, tuned as DCP's thread_count is elsewhere
        clean("ds")
        tuning[setting] = timed(ds_command(*setting))[0]
    best = min(tuning, key=tuning.get)
    commands = {
        "zs": [sys.executable, "-m", "zeroshard.cli", "reshard", "-q", "--overwrite", str(zs_ckpt),
               "--to", str(NEW_WORLD), "-o", str(outs["zs"])],
        "ds": ds_command(*best),
        "cp": f"cp -r {zs_ckpt} {outs['cp']} && sync {outs['cp']}/*",
    }
    rss: dict[str, int] = {}

    def offline(key: str):
        def run() -> float:
            wall, peak, _ = timed(commands[key], shell=isinstance(commands[key], str))
            rss[key] = max(rss.get(key, 0), peak)
            return wall
        return run

    def at_load(key: str, folder: Path):
        def run() -> float:
            time_file = work / f"time-{key}"
            launch(f"load-{key}", folder, args, nproc=NEW_WORLD, time_file=time_file)
            return float(time_file.read_text())
        return run

    sides = {k: offline(k) for k in commands}
    sides.update({"load_zs": at_load("zs", work / "zs"), "load_dcp": at_load("dcp", work / "dcp")})
    load_before = benchlib.loadavg()
    runs = benchlib.interleave(sides, args.repeat, warmup=1, before_each=clean)
    missing = params - universal_params(outs["ds"])
    if missing:
        raise SystemExit(f"ds_to_universal left out {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
    subprocess.run([sys.executable, "-m", "zeroshard.cli", "verify", "-q", "--deep", str(outs["zs"])], check=True,
                   stdout=subprocess.DEVNULL)
    rep = benchlib.Report("bench_reshard", vars(args), scope=(
        f"CPU, {benchlib.machine()['cores']} vCPUs, GPT {args.n_layer}L/{args.n_embd}d vocab {args.vocab} "
        f"({len(params)} parameter tensors) + AdamW, saved by 2 ranks "
        f"(zeroshard rank files {ckpt_bytes / 1e6:.0f} MB), to {NEW_WORLD} ranks, warm page cache; "
        f"offline tools a fresh process each, loads a torchrun launch each"))
    rep.data["load_before"] = load_before
    rep.data["ds_workers_tuning"] = {f"{e},{m}": s for (e, m), s in tuning.items()}
    labels = {"zs": f"zeroshard reshard --to {NEW_WORLD}",
              "ds": f"DeepSpeed ds_to_universal (extract {best[0]}, merge {best[1]} workers)",
              "cp": "cp -r of the rank files + sync", "load_zs": f"zeroshard load at world {NEW_WORLD} (slowest rank)",
              "load_dcp": f"DCP load + set_state_dict into FSDP2 at world {NEW_WORLD} (slowest rank)"}
    for k, label in labels.items():
        rep.runs(k, runs[k], label)
    for k in commands:
        rep.value(f"{k}_rss_MiB", rss[k] / 2**20, "MiB", f"{labels[k]}: peak RSS")
    rep.ratio("zs_vs_ds", "zs", "ds", "zeroshard reshard / DeepSpeed ds_to_universal time")
    rep.ratio("zs_vs_cp", "zs", "cp", "zeroshard reshard / cp -r + sync time")
    rep.ratio("load_zs_vs_dcp", "load_zs", "load_dcp", "zeroshard load / DCP load at the new world size")
    rep.note(f"ds_to_universal workers tried (extract, merge: seconds of one run): "
             f"{', '.join(f'({e}, {m}): {s:.2f} s' for (e, m), s in tuning.items())}; the fastest was used.")
    rep.note("ds_to_universal's output is not yet loaded: DeepSpeed loads it when the job starts at the new "
             "world size (load_universal), which this bench does not time; zeroshard reshard's output is "
             "loaded as any checkpoint, and zeroshard can also skip the offline step (the load rows).")
    shutil.rmtree(work, ignore_errors=True)
    path = rep.finish(args.json)
    print("\n" + rep.table() + "\n\n" + "\n".join(rep.data["notes"]) + f"\n\nraw JSON: {path}")


if __name__ == "__main__":
    main()
