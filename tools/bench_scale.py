"""The toolkit at large world sizes: many ranks, measured against the same I/O done by plain tools.

    python tools/bench_scale.py            # 256 -> 250 ranks of 100 tiny tensors, 10 repeats, ~2 min
    python tools/bench_scale.py --ranks 1024 --to 1000 --tensors 300 --plan-ranks 2048 --plan-tensors 2100

Part 1: `--tensors` fp32 tensors of `--numel` elements sharded to `--ranks` ranks (tiny fragments:
per-file and per-fragment costs dominate, the case where a tensors x ranks algorithm breaks).
Each command runs as its own process, interleaved with a baseline doing the same I/O
(tools/benchlib.py: one warm-up repeat, then --repeat repeats, order rotated):

- reshard ranks -> to   vs `cp -r` of the checkpoint + `sync` of each copied file (target <= 3x;
                        --copy-sync global: one `sync` instead)
- consolidate           vs `cat` of every rank file into ONE file + `sync` (target <= 1.2x: it reads
                        every rank file and writes one file, as cat does)
- verify                vs `cat` of every rank file to /dev/null          (target <= 2x)
- shard -> to           vs reshard ranks -> to, which writes the same files (target <= 1.2x;
                        only with --only ...,shard: the model file is kept for it)

Reported: the median and IQR of the paired ratios (command / baseline, per repeat), the peak RSS
of each command, and (--in-process) its time after interpreter start-up and imports.
Part 2: a `--plan-ranks`-rank checkpoint of `--plan-tensors` tensors: `zeroshard inspect` and load
planning for one rank, each a fresh process (median seconds; inspect's peak RSS, bar 200 MiB).
Raw JSON: tools/results/bench_scale.json, with --floor tools/results/bench_scale_floor.json (--json PATH
elsewhere).

    python tools/bench_scale.py --floor --tensors 300 --numel 16384 --ranks 1024 --to 1000 --few 8

`--floor`: the per-file floor of the filesystem, against our own per-file cost, all interleaved.
Our ratios: reshard ranks -> to / reshard few -> few-1, and consolidate from ranks / from few, of
the same bytes. The floor's: our commit's durability steps alone (each file created under a temp
name and written once, renamed, all fsynced (Location.fsync), then one small manifest written
atomically: zeroshard.storage, as reshard does) for `to` files vs few-1 files of the same total
bytes, timed inside the process, and its creates and renames alone (empty files, no fsync); `cp -r`
+ `sync` of each such folder; `cat` of every rank file into one file + `sync` for each checkpoint
(consolidate's floor). The total is the tensor data (tensors x numel x 4): a rank file's header
lists every tensor, so the 1,000-rank checkpoint itself is bigger.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_env import use_compiled_bytecode  # tools/, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import benchlib  # noqa: E402

from bench_toolkit import timed  # noqa: E402  (same measuring: wall, child peak RSS, CPU)

# issue 55: a command's peak RSS stays under this at 1,024, 4,096 and 16,384 ranks alike
RSS_BOUND_MIB = 256


def zeroshard(*args: str) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli", *args, "-q"]


IN_PROCESS = """
import importlib, sys, time
import zeroshard.cli
for module in sys.argv[1].split():
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:  # an older zeroshard (PYTHONPATH) without it
        pass
start = time.perf_counter()
sys.argv = ["zeroshard"] + sys.argv[2:]
try:
    zeroshard.cli.main()
except SystemExit as exc:
    if exc.code:
        raise
finally:
    sys.stderr.write(f"\\nin-process {time.perf_counter() - start:.4f}\\n")
"""


def in_process(command: list[str]) -> float:
    """Seconds the command spends after start-up and imports (see IN_PROCESS)."""
    args = command[command.index("zeroshard.cli") + 1:]
    proc = subprocess.run([sys.executable, "-c", IN_PROCESS, benchlib.TOOLKIT_MODULES[args[0]], *args],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"failed: {command}\n{proc.stderr}")
    return float(proc.stderr.rsplit("in-process", 1)[1])


def start_up(command: str, repeat: int) -> list[float]:
    """Every run's wall time of interpreter start-up plus the command's imports, doing nothing
    else (the report quotes their median and IQR, never the fastest)."""
    return [timed(benchlib.start_up_command(command))[0] for _ in range(repeat)]


def build(path: Path, tensors: int, numel: int, world: int, keep_model: bool = False) -> float:
    """A `world`-rank checkpoint of `tensors` fp32 tensors of `numel` elements; returns build seconds.
    keep_model: the model file it is sharded from stays, as model_of(path)."""
    code = f"""
import numpy as np, sys
from safetensors.numpy import save_file
save_file({{f"layer.{{i}}.weight": np.random.default_rng(i).standard_normal({numel}, dtype=np.float32)
           for i in range({tensors})}}, sys.argv[1])
"""
    model = model_of(path)
    subprocess.run([sys.executable, "-c", code, str(model)], check=True)
    subprocess.run(zeroshard("shard", str(model), str(path) + "-w1", "--world", "1"), check=True, capture_output=True)
    start = time.perf_counter()
    subprocess.run(zeroshard("reshard", str(path) + "-w1", "--to", str(world), "-o", str(path)), check=True,
                   capture_output=True)
    elapsed = time.perf_counter() - start
    shutil.rmtree(str(path) + "-w1")
    if not keep_model:
        model.unlink()
    return elapsed


def model_of(path: Path) -> Path:
    return path.parent / f"{path.name}-model.safetensors"


PLAN_ONE_RANK = """
import sys, time
start = time.perf_counter()
from zeroshard.format import CheckpointReader, open_checkpoint
from zeroshard.format.reader import fragments_of
from zeroshard.partition import shard_range
location, manifest = open_checkpoint(sys.argv[1])
rank, world = int(sys.argv[2]), manifest.world_size
files = set()
pieces = 0
for t in manifest.tensors.values():
    s, e = shard_range(t.numel, world, rank) if t.layout == "flat" else (0, t.numel)
    for holder, _, _ in fragments_of(t, world, s, e):
        files.add(holder)
        pieces += 1
with CheckpointReader(location, manifest) as reader:
    for holder in sorted(files):
        reader.open_file(holder)  # header read and checked against the manifest
print(f"{time.perf_counter() - start:.3f} {pieces} {len(files)}")
"""


# Our commit's durability steps alone (reshard's: zeroshard.toolkit.packed, format/output.py):
# every file created under a temp name with one write, renamed, then all made durable together
# (Location.fsync), then the manifest, committed last. Timed from the first create.
FLOOR = """
import os, sys, time
from zeroshard.storage.location import Location
from zeroshard.storage.mapped_file import move_into_place
folder, files, total, steps = Location(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
data = os.urandom(total // files) if steps == "all" else b""  # incompressible; "create": empty files only
names = [f"rank-{r:05d}-of-{files:05d}.safetensors" for r in range(files)]
start = time.perf_counter()
for name in names:
    temp = folder.temp_name(name)
    if not folder.create_exclusive(temp, data, durable=False):
        raise SystemExit("exists")
    move_into_place(folder, folder.full_path(temp), name)
if steps == "all":
    folder.fsync(names)
    folder.write_bytes("zeroshard.json", b"{}")
print(f"{time.perf_counter() - start:.6f}")
"""


def floor(args: argparse.Namespace, rep: benchlib.Report, work: Path) -> None:
    """The per-file floor against our per-file cost (see the module docstring, --floor)."""
    many, few = work / "many", work / "few"
    build(many, args.tensors, args.numel, args.ranks)
    build(few, args.tensors, args.numel, args.few)
    total = args.tensors * args.numel * 4  # the tensor data (rank files' headers grow with ranks x tensors)
    out = work / "out"

    def clean(_name: str = "") -> None:
        for p in (out, work / "copy", work / "cat.bin", work / "out.safetensors"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        subprocess.run("sync", shell=True)

    def floor_files(files: int, steps: str = "all"):
        def run() -> float:
            proc = subprocess.run([sys.executable, "-c", FLOOR, str(out), str(files), str(total), steps],
                                  check=True, capture_output=True, text=True)
            return float(proc.stdout.split()[-1])
        return run

    def shell(cmd: str):
        return lambda: timed(cmd, shell=True)[0]

    def made(files: int) -> Path:  # a folder of `files` files of `total` bytes, for cp -r
        folder = work / f"made{files}"
        subprocess.run([sys.executable, "-c", FLOOR, str(folder), str(files), str(total), "all"], check=True,
                       capture_output=True)
        return folder

    to_many, to_few = made(args.to), made(args.few - 1)
    cp = f"cp -r {{}} {work}/copy && sync {work}/copy/*"
    cat = f"cat {{}}/*.safetensors > {work}/cat.bin && sync {work}/cat.bin"
    sides = {
        "reshard_many": lambda: timed(zeroshard("reshard", str(many), "--to", str(args.to), "-o", str(out)))[0],
        "reshard_few": lambda: timed(zeroshard("reshard", str(few), "--to", str(args.few - 1), "-o", str(out)))[0],
        "floor_many": floor_files(args.to), "floor_few": floor_files(args.few - 1),
        "create_many": floor_files(args.to, "create"), "create_few": floor_files(args.few - 1, "create"),
        "cp_many": shell(cp.format(to_many)), "cp_few": shell(cp.format(to_few)),
        "consolidate_many": lambda: timed(zeroshard("consolidate", str(many), str(work / "out.safetensors")))[0],
        "consolidate_few": lambda: timed(zeroshard("consolidate", str(few), str(work / "out.safetensors")))[0],
        "cat_many": shell(cat.format(many)), "cat_few": shell(cat.format(few)),
    }
    runs = benchlib.interleave(sides, args.repeat, warmup=1, before_each=clean)
    mb = f"{total / 1e6:.1f} MB"
    labels = {"reshard": (f"zeroshard reshard {args.ranks} -> {args.to}", f"zeroshard reshard {args.few} -> "
                          f"{args.few - 1}"),
              "floor": (f"commit steps alone, {args.to} files of {mb} (in-process)",
                        f"commit steps alone, {args.few - 1} files of {mb} (in-process)"),
              "create": (f"create + rename alone, {args.to} empty files (in-process)",
                         f"create + rename alone, {args.few - 1} empty files (in-process)"),
              "cp": (f"cp -r + sync, {args.to} files", f"cp -r + sync, {args.few - 1} files"),
              "consolidate": (f"zeroshard consolidate from {args.ranks} ranks", f"zeroshard consolidate from "
                              f"{args.few} ranks"),
              "cat": (f"cat of {args.ranks} rank files + sync", f"cat of {args.few} rank files + sync")}
    for key, (many_label, few_label) in labels.items():
        rep.runs(f"{key}_many", runs[f"{key}_many"], many_label)
        rep.runs(f"{key}_few", runs[f"{key}_few"], few_label)
    for key, target in (("reshard", "<= 1.3"), ("floor", None), ("create", None), ("cp", None),
                        ("consolidate", "<= 1.3"), ("cat", None)):
        rep.ratio(f"{key}_many_vs_few", f"{key}_many", f"{key}_few", f"{labels[key][0]} / {labels[key][1]}",
                  target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--to", type=int, default=250)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--plan-ranks", type=int, default=512)
    parser.add_argument("--plan-tensors", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=10, help="interleaved repeats (after one warm-up)")
    parser.add_argument("--workers", default="1", help="comma-separated -j values to time (e.g. 1,2)")
    parser.add_argument("--in-process", action="store_true", help="also time each command after its imports")
    parser.add_argument("--dir", default="/tmp/zs-scale")
    parser.add_argument("--json", default=None, help="result file (default tools/results/bench_scale.json)")
    parser.add_argument("--skip-part2", action="store_true")
    parser.add_argument("--only", default="reshard,consolidate,verify", help="which part-1 operations to run")
    parser.add_argument("--copy-sync", choices=["files", "global"], default="files",
                        help="reshard's baseline: cp -r, then fsync each copied file (files: what reshard "
                             "guarantees its outputs) or one global sync")
    parser.add_argument("--floor", action="store_true", help="only the per-file floor (see the docstring)")
    parser.add_argument("--few", type=int, default=8, help="--floor: the few-rank side (few -> few - 1)")
    args = parser.parse_args()
    use_compiled_bytecode()
    rep = benchlib.Report("bench_scale", vars(args), scope=(
        f"CPU, {benchlib.machine()['cores']} vCPUs, local disk (write-cached virtual disk), warm page cache, "
        f"each command a fresh process (start-up included)"))
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt, copy, out = work / "ckpt", work / "copy", work / "out"
    if args.floor:
        floor(args, rep, work)
        shutil.rmtree(work, ignore_errors=True)
        # its own file: the floor run must not replace the main run's results
        default = benchlib.RESULTS / "bench_scale_floor.json"
        print("\n" + rep.table() + f"\n\nraw JSON: {rep.finish(args.json or default)}")
        return

    built = build(ckpt, args.tensors, args.numel, args.ranks, keep_model="shard" in args.only.split(","))
    manifest_bytes = (ckpt / "zeroshard.json").stat().st_size
    files = sorted(ckpt.iterdir())
    total = sum(f.stat().st_size for f in files)
    print(f"checkpoint: {args.tensors} x {args.numel} fp32 over {args.ranks} ranks, {len(files)} files, "
          f"{total / 1e6:.1f} MB; built by reshard 1 -> {args.ranks} in {built:.2f} s; manifest "
          f"{manifest_bytes / 1e3:.1f} kB")
    rep.value("manifest_kB", manifest_bytes / 1e3, "kB", f"manifest of {args.ranks} ranks x {args.tensors} tensors")

    def clean(_name: str = "") -> None:
        for p in (copy, out, work / "out.safetensors", work / "cat.bin"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        subprocess.run("sync", shell=True)

    # baselines doing the same I/O as the command: reshard writes a folder of rank files (cp -r),
    # consolidate writes ONE file from every rank file (cat into one file), verify reads all (cat)
    cases = [
        ("reshard", f"reshard {args.ranks} -> {args.to}", 3.0,
         lambda j: zeroshard("reshard", str(ckpt), "--to", str(args.to), "-o", str(out), "-j", str(j)),
         f"cp -r {ckpt} {copy} && sync" + ("" if args.copy_sync == "global" else f" {copy}/*"),
         "cp -r + sync" + (" (one global sync)" if args.copy_sync == "global" else "")),
        ("consolidate", "consolidate", 1.2,
         lambda j: zeroshard("consolidate", str(ckpt), str(work / "out.safetensors"), "-j", str(j)),
         f"cat {ckpt}/*.safetensors > {work}/cat.bin && sync {work}/cat.bin", "cat of the rank files + sync"),
        ("verify", "verify", 2.0, lambda j: zeroshard("verify", str(ckpt), "-j", str(j)),
         f"cat {ckpt}/*.safetensors > /dev/null", "cat > /dev/null"),
        # shard writes the files a reshard to the same world size writes: that reshard is its baseline
        ("shard", f"shard -> {args.to}", 1.2, lambda j: zeroshard("shard", str(model_of(ckpt)), str(out), "--world",
                                                                   str(args.to)),
         zeroshard("reshard", str(ckpt), "--to", str(args.to), "-o", str(out), "-j", "1"),
         f"reshard {args.ranks} -> {args.to} (the same files)"),
    ]
    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    rss: dict[str, int] = {}
    for command, name, bar, ours, base, base_label in cases:
        if command not in args.only.split(","):
            continue

        def side(cmd, key):
            def run() -> float:
                wall, peak, _ = timed(cmd, shell=isinstance(cmd, str))
                rss[key] = max(rss.get(key, 0), peak)
                return wall
            return run

        sides = {f"{command}_j{j}": side(ours(j), f"{command}_j{j}") for j in workers}
        sides[f"{command}_base"] = side(base, f"{command}_base")
        runs = benchlib.interleave(sides, args.repeat, warmup=1, before_each=clean)
        rep.runs(f"{command}_base", runs[f"{command}_base"], f"{base_label} (baseline of {command})")
        for j in workers:
            key = f"{command}_j{j}"
            rep.runs(key, runs[key], f"zeroshard {name}, -j {j}")
            rep.ratio(f"{key}_vs_base", key, f"{command}_base", f"{name} -j {j} / {base_label}", f"<= {bar:g}")
            rep.value(f"{key}_rss_MiB", rss[key] / 2**20, "MiB", f"{name} -j {j}: peak RSS",
                      f"<= {RSS_BOUND_MIB}")
            if args.in_process:
                clean()
                rep.value(f"{key}_in_process_s", in_process(ours(j)), "s", f"{name} -j {j}: after start-up")
        rep.runs(f"{command}_start_up", start_up(command, max(args.repeat, 5)),
                 f"{command}: interpreter + imports alone")
    clean()
    shutil.rmtree(ckpt)
    model_of(ckpt).unlink(missing_ok=True)

    if not args.skip_part2:
        big = work / "plan"
        build(big, args.plan_tensors, args.plan_ranks, args.plan_ranks)  # one element per rank
        runs = benchlib.interleave({
            "inspect": lambda: timed(zeroshard("inspect", str(big), "--json"))[0],
            "plan_rank0": lambda: timed([sys.executable, "-c", PLAN_ONE_RANK, str(big), "0"])[0],
        }, args.repeat, warmup=1)
        rep.runs("inspect", runs["inspect"], f"zeroshard inspect, {args.plan_ranks} ranks x {args.plan_tensors} "
                                             f"tensors (process)")
        rep.runs("plan_rank0", runs["plan_rank0"], "load planning for rank 0 (process)")
        rep.value("inspect_rss_MiB", timed(zeroshard("inspect", str(big), "--json"))[1] / 2**20, "MiB",
                  "zeroshard inspect: peak RSS", "<= 200")
    shutil.rmtree(work, ignore_errors=True)
    path = rep.finish(args.json)
    print("\n" + rep.table() + f"\n\nraw JSON: {path}")


if __name__ == "__main__":
    main()
