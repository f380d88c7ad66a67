"""The toolkit at real world sizes: thousands of ranks, measured against raw copies in the same run.

    python tools/bench_scale.py [--ranks 1024] [--to 1000] [--tensors 300] [--numel 4096]
                                [--plan-ranks 2048] [--plan-tensors 2100] [--dir /tmp/zs-scale]
                                [--repeat 3] [--only reshard,consolidate,verify] [--skip-part2]

Part 1 (issue 7's bars): `--tensors` fp32 tensors of `--numel` elements sharded to `--ranks` ranks
(tiny fragments: every operation is dominated by per-file and per-fragment costs, the case where a
tensors x ranks algorithm breaks). Each command runs as its own process, interleaved with its
baseline, best of `--repeat`:

- manifest bytes (bar: <= 1 MB),
- reshard ranks -> to   vs `cp -r` of the checkpoint + `sync`   (bar: <= 3x),
- consolidate           vs `cp -r` of the checkpoint + `sync`   (bar: <= 3x; it reads every rank file),
- verify                vs `cat` of every file to /dev/null      (bar: <= 2x),
each also with --workers 2. Reported: best and median wall time of the command as a process
(what the bar is written for), and best in-process time: the same command run by a wrapper that
imports the CLI and the command's modules first and times only `main()`, so what is fixed
(interpreter start-up and imports, also shown alone) and what scales with the checkpoint can be
told apart. The load average is printed before and after: the machine is shared.

Part 2: a synthetic `--plan-ranks`-rank checkpoint of `--plan-tensors` tiny tensors (built by
resharding a 1-rank one, itself timed): `zeroshard inspect`, and load planning for one rank at
the same world size (parse the manifest, compute the rank's ranges of every tensor, find and open
the rank files holding them), each in a fresh process, wall time and peak RSS
(bars: <= 1 s, <= 200 MiB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_env import use_compiled_bytecode  # tools/, beside this script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from bench_toolkit import timed  # noqa: E402  (same measuring: wall, child peak RSS, CPU)


def zeroshard(*args: str) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli", *args, "-q"]


# The modules each command imports before it touches the checkpoint (start-up, a fixed cost).
MODULES = {"reshard": "zeroshard.toolkit.reshard zeroshard.toolkit.packed",
           "consolidate": "zeroshard.toolkit.consolidate zeroshard.toolkit.gather",
           "verify": "zeroshard.toolkit.verify"}

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
    proc = subprocess.run([sys.executable, "-c", IN_PROCESS, MODULES[args[0]], *args], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"failed: {command}\n{proc.stderr}")
    return float(proc.stderr.rsplit("in-process", 1)[1])


def start_up(command: str, repeat: int) -> float:
    """Best wall time of interpreter start-up plus the command's imports, doing nothing else."""
    code = (f"import importlib, zeroshard.cli\nfor m in {MODULES[command].split()!r}:\n"
            f"    try: importlib.import_module(m)\n    except ModuleNotFoundError: pass")
    return min(timed([sys.executable, "-c", code])[0] for _ in range(repeat))


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def build(path: Path, tensors: int, numel: int, world: int) -> float:
    """A `world`-rank checkpoint of `tensors` fp32 tensors of `numel` elements; returns build seconds."""
    code = f"""
import numpy as np, sys
from safetensors.numpy import save_file
save_file({{f"layer.{{i}}.weight": np.random.default_rng(i).standard_normal({numel}, dtype=np.float32)
           for i in range({tensors})}}, sys.argv[1])
"""
    model = path.parent / f"{path.name}-model.safetensors"
    subprocess.run([sys.executable, "-c", code, str(model)], check=True)
    subprocess.run(zeroshard("shard", str(model), str(path) + "-w1", "--world", "1"), check=True, capture_output=True)
    start = time.perf_counter()
    subprocess.run(zeroshard("reshard", str(path) + "-w1", "--to", str(world), "-o", str(path)), check=True,
                   capture_output=True)
    elapsed = time.perf_counter() - start
    shutil.rmtree(str(path) + "-w1")
    model.unlink()
    return elapsed


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--to", type=int, default=1000)
    parser.add_argument("--tensors", type=int, default=300)
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--plan-ranks", type=int, default=2048)
    parser.add_argument("--plan-tensors", type=int, default=2100)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/zs-scale")
    parser.add_argument("--skip-part2", action="store_true")
    parser.add_argument("--only", default="reshard,consolidate,verify", help="which part-1 operations to run")
    args = parser.parse_args()
    use_compiled_bytecode()
    print(load())
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt, copy, out = work / "ckpt", work / "copy", work / "out"

    built = build(ckpt, args.tensors, args.numel, args.ranks)
    manifest_bytes = (ckpt / "zeroshard.json").stat().st_size
    files = sorted(ckpt.iterdir())
    total = sum(f.stat().st_size for f in files)
    print(f"checkpoint: {args.tensors} x {args.numel} fp32 over {args.ranks} ranks, {len(files)} files, "
          f"{total / 1e6:.1f} MB (data {args.tensors * args.numel * 4 / 1e6:.1f} MB); built by reshard 1 -> "
          f"{args.ranks} in {built:.2f} s; manifest {manifest_bytes / 1e3:.1f} kB (bar <= 1000 kB)")

    def clean():
        for p in (copy, out, work / "out.safetensors"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        subprocess.run("sync", shell=True)

    cases = [
        (f"reshard {args.ranks} -> {args.to}", 3.0,
         lambda j: zeroshard("reshard", str(ckpt), "--to", str(args.to), "-o", str(out), "-j", str(j)),
         f"cp -r {ckpt} {copy} && sync {copy}/*"),
        ("consolidate", 3.0,
         lambda j: zeroshard("consolidate", str(ckpt), str(work / "out.safetensors"), "-j", str(j)),
         f"cp -r {ckpt} {copy} && sync {copy}/*"),
        ("verify", 2.0, lambda j: zeroshard("verify", str(ckpt), "-j", str(j)),
         f"cat {ckpt}/*.safetensors > /dev/null"),
    ]
    print("\n| operation | workers | wall s, best (median) | in-process s, best | baseline s, best (median) | "
          "ratio wall | ratio in-process | bar | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    starts = {}
    for name, bar, ours, base in cases:
        if name.split()[0] not in args.only.split(","):
            continue
        command = name.split()[0]
        starts[command] = start_up(command, args.repeat)
        runs: dict[str, list[tuple[float, int]]] = {"1": [], "2": [], "base": []}
        inner: dict[str, list[float]] = {"1": [], "2": []}
        for _ in range(args.repeat):
            for key, cmd in (("1", ours(1)), ("2", ours(2)), ("base", base)):
                clean()
                runs[key].append(timed(cmd, shell=isinstance(cmd, str)))
                if key != "base":
                    clean()
                    inner[key].append(in_process(cmd))
        baseline = min(w for w, *_ in runs["base"])
        base_median = statistics.median(w for w, *_ in runs["base"])
        for key in ("1", "2"):
            wall = min(w for w, *_ in runs[key])
            median = statistics.median(w for w, *_ in runs[key])
            rss = max(r for _, r, *_ in runs[key])
            own = min(inner[key])
            print(f"| {name} | {key} | {wall:.2f} ({median:.2f}) | {own:.2f} | {baseline:.2f} ({base_median:.2f}) | "
                  f"{wall / baseline:.2f}x | {own / baseline:.2f}x | <= {bar:.0f}x | {rss / 2**20:.0f} |")
    print("\nstart-up alone (interpreter + the command's imports, best): "
          + ", ".join(f"{c} {s:.2f} s" for c, s in starts.items()))
    print(load())
    clean()
    shutil.rmtree(ckpt)

    if args.skip_part2:
        return
    big = work / "plan"
    built = build(big, args.plan_tensors, args.plan_ranks, args.plan_ranks)  # one element per rank
    size = sum(f.stat().st_size for f in big.iterdir())
    print(f"\ncheckpoint: {args.plan_tensors} tensors over {args.plan_ranks} ranks ({size / 1e6:.0f} MB, manifest "
          f"{(big / 'zeroshard.json').stat().st_size / 1e3:.0f} kB), built by reshard 1 -> {args.plan_ranks} "
          f"in {built:.1f} s")
    print("\n| step | wall s | peak RSS MiB | bars |\n|---|---|---|---|")
    wall, rss, _ = min(timed(zeroshard("inspect", str(big), "--json")) for _ in range(args.repeat))
    print(f"| zeroshard inspect | {wall:.2f} | {rss / 2**20:.0f} | <= 1 s, <= 200 MiB |")
    for rank in (0, args.plan_ranks // 2):
        results = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", PLAN_ONE_RANK, str(big), str(rank)], capture_output=True,
                                  text=True, check=True)
            results.append((time.perf_counter() - start, proc.stdout.split()))
        wall, (inner, pieces, nfiles) = min(results)
        _, rss, _ = timed([sys.executable, "-c", PLAN_ONE_RANK, str(big), str(rank)])
        print(f"| load planning, rank {rank} ({pieces} ranges in {nfiles} file(s)) | {wall:.2f} (in-process "
              f"{float(inner):.2f}) | {rss / 2**20:.0f} | <= 1 s, <= 200 MiB |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
