"""Peak memory and speed of `zeroshard import dcp|deepspeed` on a big checkpoint (issue 18).

    python tools/bench_import.py --source dcp         # 2 GiB model-only DCP checkpoint, 3 repeats
    python tools/bench_import.py --source deepspeed   # 2 GiB DeepSpeed ZeRO-3 checkpoint, 3 repeats
    python tools/bench_import.py --gib 0.25 --repeats 2   # quick check
    python tools/bench_import.py --before /tmp/old         # also time an older checkout's import

dcp: written once by real `torch.distributed.checkpoint.save` (one process: one chunk per
tensor) into --dir: `--tensors` fp32 tensors adding up to --gib. deepspeed: a 2-rank ZeRO-3
checkpoint in the layout of tests/data/deepspeed/stage3 (DeepSpeed 0.19.8's engine save),
written with torch.save by make_deepspeed below: `--tensors` fp32 parameters, each rank's file
holding its padded ceil(n/2) slice of every parameter (fp32 master, exp_avg, exp_avg_sq) in
sub-groups of 8 parameters; the files add up to --gib. Then, interleaved
(tools/benchlib.py: --warmup repeats dropped, the order rotated from repeat to repeat), each
repeat runs: `cp -r SRC DST && sync` (the floor: the bytes read and written once, made
durable), the import to `--world 2` as shipped (streaming), and the same import with every
tensor read whole first (`LAZY_BYTES` raised: how imports worked before). Each is a fresh
process; its peak RSS is wait4's ru_maxrss. Reported: medians and IQR of wall time and of the
paired ratios against cp, the median peak RSS (target <= 512 MiB), machine and load average, in
tools/results/bench_import_SOURCE.json. Scope: CPU, local disk, warm page cache (the source is
read right after being written and between repeats).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import benchlib  # noqa: E402

MiB = 1 << 20
WHOLE = 1 << 60  # LAZY_BYTES for "read every tensor whole"


def make_dcp(src: Path, gib: float, tensors: int) -> int:
    """A model-only DCP checkpoint of `tensors` fp32 [rows, 1024] tensors, in a child process."""
    rows = max(1, int(gib * (1 << 30) / tensors / 4 / 1024))
    code = (f"import torch, torch.distributed.checkpoint as dcp, warnings; warnings.simplefilter('ignore'); "
            f"g = torch.Generator().manual_seed(0); "
            f"sd = {{f'layers.{{i}}.weight': torch.randn({rows}, 1024, generator=g) for i in range({tensors})}}; "
            f"dcp.save({{'model': sd}}, checkpoint_id={str(src)!r})")
    subprocess.run([sys.executable, "-c", code], check=True)
    return sum(f.stat().st_size for f in src.iterdir())


def make_deepspeed(folder: Path, shapes: dict[str, tuple[int, ...]], world: int,
                   values: Callable[[str, str], Any], per_group: int = 8) -> None:
    """A DeepSpeed ZeRO-3 checkpoint at `folder` (`latest` -> global_step3), in the layout of
    tests/data/deepspeed/stage3: `values(name, kind)` is the full tensor of parameter `name` for
    kind "fp32", "exp_avg" or "exp_avg_sq"; each rank keeps its padded ceil(n/world) slice of
    each, per sub-group of `per_group` parameters. One rank's file is built at a time."""
    import torch

    tag = folder / "global_step3"
    tag.mkdir(parents=True)
    (folder / "latest").write_text("global_step3")
    names = list(shapes)
    groups = [names[i:i + per_group] for i in range(0, len(names), per_group)]
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    hyper = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "params": list(range(len(groups)))}
    for rank in range(world):
        flat_groups, state = [], {}
        for g, group in enumerate(groups):
            parts: dict[str, list] = {"fp32": [], "exp_avg": [], "exp_avg_sq": []}
            for name in group:
                part = math.ceil(math.prod(shapes[name]) / world)
                for kind, pieces in parts.items():
                    mine = values(name, kind).reshape(-1)[rank * part:(rank + 1) * part]
                    pieces.append(torch.cat([mine, torch.zeros(part - mine.numel())]))  # the padding
            flat_groups.append(torch.cat(parts.pop("fp32")))
            state[g] = {"step": torch.tensor(3.0), **{k: torch.cat(v) for k, v in parts.items()}}
        torch.save({"optimizer_state_dict": {
            "zero_stage": 3, "loss_scaler": None, "dynamic_loss_scale": False, "overflow": False,
            "partition_count": world, "optimizer_state_dict": {"state": state, "param_groups": [hyper]},
            "fp32_flat_groups": flat_groups}, "ds_config": config, "ds_version": "0.19.8"},
            tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        del flat_groups, state
        torch.save({"module": {n: torch.empty(0) for n in names}, "buffer_names": [], "optimizer": None,
                    "param_shapes": [{n: torch.Size(shapes[n]) for n in names}], "frozen_param_shapes": {},
                    "shared_params": {}, "lr_scheduler": None, "skipped_steps": 0, "global_steps": 3,
                    "global_samples": 24, "dp_world_size": world, "mp_world_size": 1, "ds_config": config,
                    "ds_version": "0.19.8"}, tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")


def seeded_values(shapes: dict[str, tuple[int, ...]]) -> Callable[[str, str], Any]:
    """values() for make_deepspeed: reproducible normal values per (parameter, kind)."""
    import torch

    kinds = {"fp32": 0, "exp_avg": 1, "exp_avg_sq": 2}
    index = {name: i for i, name in enumerate(shapes)}

    def values(name: str, kind: str) -> Any:
        g = torch.Generator().manual_seed(3 * index[name] + kinds[kind])
        value = torch.randn(shapes[name], generator=g)
        return value.abs_() if kind == "exp_avg_sq" else value

    return values


def _make_deepspeed_child(src: Path, gib: float, tensors: int) -> int:
    """A >= `gib` DeepSpeed ZeRO-3 checkpoint of `tensors` [rows, 1024] parameters (3 fp32 arrays
    each), written in a child process so its memory is not the benchmark's."""
    rows = max(1, math.ceil(gib * (1 << 30) / tensors / 12 / 1024))
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from pathlib import Path; "
            f"import bench_import as b; shapes = {{f'layers.{{i}}.weight': ({rows}, 1024) for i in range({tensors})}}; "
            f"b.make_deepspeed(Path({str(src)!r}), shapes, 2, b.seeded_values(shapes))")
    subprocess.run([sys.executable, "-c", code], check=True)
    return sum(f.stat().st_size for f in (src / "global_step3").iterdir())


def timed(cmd: list[str] | str, shell: bool = False, root: Path = ROOT) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process (and its children), running the
    zeroshard at `root`."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/",
                            env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {cmd}\n{proc.stderr.read().decode()}")
    return wall, usage.ru_maxrss * 1024


def import_cmd(source: str, src: Path, out: Path, lazy_bytes: int | None) -> list[str]:
    setup = "" if lazy_bytes is None else (
        f"import zeroshard.interop.dcp_chunks as c, zeroshard.interop.torch_zip as z; "
        f"c.LAZY_BYTES = z.LAZY_BYTES = {lazy_bytes}; ")
    return [sys.executable, "-c", setup + "import sys; from zeroshard.cli import main; sys.argv[0] = 'zeroshard'; "
            "main()", "import", source, str(src), str(out), "--world", "2", "--overwrite", "-q"]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=["dcp", "deepspeed"], default="dcp")
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="interleaved repeats run first and not counted")
    parser.add_argument("--dir", default="/tmp/zeroshard-bench-import")
    parser.add_argument("--json", default=None, help="result file (default tools/results/bench_import_SOURCE.json)")
    parser.add_argument("--before", default=None, help="a checkout of an older zeroshard: its import is timed too "
                        "(e.g. `git archive COMMIT | tar -x -C DIR`)")
    args = parser.parse_args()

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / args.source
    if args.source == "dcp":
        size = make_dcp(src, args.gib, args.tensors)
        described = (f"DCP source {size / (1 << 30):.2f} GiB in {args.tensors} tensors of "
                     f"{size / args.tensors / MiB:.0f} MiB (real dcp.save, model-only)")
    else:
        size = _make_deepspeed_child(src, args.gib, args.tensors)
        described = (f"DeepSpeed ZeRO-3 source {size / (1 << 30):.2f} GiB, 2 ranks, {args.tensors} fp32 "
                     f"parameters of {size / 3 / args.tensors / MiB:.0f} MiB (+ exp_avg, exp_avg_sq)")
    commands: dict[str, tuple[Any, bool, Path]] = {
        "cp": (f"cp -r {src} {work / 'out-cp'} && sync", True, ROOT),
        "streaming": (import_cmd(args.source, src, work / "out-streaming", None), False, ROOT),
        "whole": (import_cmd(args.source, src, work / "out-whole", WHOLE), False, ROOT)}
    if args.before:
        commands["before"] = (import_cmd(args.source, src, work / "out-before", None), False,
                              Path(args.before).resolve())
    rss: dict[str, list[int]] = {name: [] for name in commands}

    def side(name: str) -> Callable[[], float]:
        def run() -> float:
            cmd, shell, root = commands[name]
            wall, peak = timed(cmd, shell=shell, root=root)
            rss[name].append(peak)
            return wall
        return run

    def clean(name: str) -> None:
        shutil.rmtree(work / f"out-{name}", ignore_errors=True)
        subprocess.run("sync", shell=True)

    rep = benchlib.Report("bench_import", vars(args), scope=(
        f"CPU, {benchlib.machine()['cores']} vCPUs, {described}, imported to 2 ranks, local disk, warm page "
        f"cache; each run a fresh process, peak RSS by wait4"))
    runs = benchlib.interleave({name: side(name) for name in commands}, args.repeats, warmup=args.warmup,
                               before_each=clean)
    labels = {"cp": "cp -r + sync (the floor)", "streaming": f"zeroshard import {args.source} (streaming, shipped)",
              "whole": "the same import, every tensor read whole first", "before": f"zeroshard at {args.before}"}
    for name in commands:
        rep.runs(name, runs[name], labels[name])
    for name in commands:
        if name != "cp":
            rep.ratio(f"{name}_vs_cp", name, "cp", f"{labels[name]} / cp time")
    if "before" in commands:
        rep.ratio("streaming_vs_before", "streaming", "before", f"shipped / {labels['before']} time")
    for name in commands:
        rep.value(f"{name}_rss_MiB", statistics.median(rss[name]) / MiB, "MiB", f"{labels[name]}: peak RSS (median)",
                  "<= 512" if name == "streaming" else None)
    path = rep.finish(args.json or benchlib.RESULTS / f"bench_import_{args.source}.json")
    print("\n" + rep.table() + f"\n\nraw JSON: {path}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
