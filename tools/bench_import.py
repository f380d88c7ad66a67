"""Peak memory and speed of `zeroshard import dcp` on a big DCP checkpoint (issue 18).

    python tools/bench_import.py                    # 2 GiB model-only DCP checkpoint, 3 repeats
    python tools/bench_import.py --gib 0.25 --repeats 2   # quick check

The checkpoint is written once by real `torch.distributed.checkpoint.save` (one process: one
chunk per tensor) into --dir: `--tensors` fp32 tensors adding up to --gib. Then, interleaved,
each repeat runs: `cp -r SRC DST && sync` (the floor: the bytes read and written once, made
durable), `zeroshard import dcp SRC OUT --world 2` as shipped (streaming), and the same import
with every tensor read whole first (`dcp_chunks.LAZY_BYTES` raised: how imports worked before).
Each is a fresh process; its peak RSS is wait4's ru_maxrss. Reported: medians with min-max of
wall time, of the paired ratio against cp, and of peak RSS. Scope: CPU, local disk, warm page
cache (the source is read right after being written and between repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
WHOLE = 1 << 60  # LAZY_BYTES for "read every tensor whole"


def make_checkpoint(src: Path, gib: float, tensors: int) -> int:
    """A model-only DCP checkpoint of `tensors` fp32 [rows, 1024] tensors, in a child process."""
    rows = max(1, int(gib * (1 << 30) / tensors / 4 / 1024))
    code = (f"import torch, torch.distributed.checkpoint as dcp, warnings; warnings.simplefilter('ignore'); "
            f"g = torch.Generator().manual_seed(0); "
            f"sd = {{f'layers.{{i}}.weight': torch.randn({rows}, 1024, generator=g) for i in range({tensors})}}; "
            f"dcp.save({{'model': sd}}, checkpoint_id={str(src)!r})")
    subprocess.run([sys.executable, "-c", code], check=True)
    return sum(f.stat().st_size for f in src.iterdir())


def timed(cmd: list[str] | str, shell: bool = False) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process (and its children)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {cmd}\n{proc.stderr.read().decode()}")
    return wall, usage.ru_maxrss * 1024


def import_cmd(src: Path, out: Path, lazy_bytes: int | None) -> list[str]:
    setup = "" if lazy_bytes is None else f"import zeroshard.interop.dcp_chunks as c; c.LAZY_BYTES = {lazy_bytes}; "
    return [sys.executable, "-c", setup + "import sys; from zeroshard.cli import main; sys.argv[0] = 'zeroshard'; "
            "main()", "import", "dcp", str(src), str(out), "--world", "2", "--overwrite", "-q"]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/zeroshard-bench-import")
    parser.add_argument("--json", default=None, help="write the raw measurements here")
    args = parser.parse_args()

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = work / "dcp"
    size = make_checkpoint(src, args.gib, args.tensors)
    print(f"source: {size / (1 << 30):.2f} GiB in {args.tensors} tensors of "
          f"{size / args.tensors / MiB:.0f} MiB (real dcp.save, model-only)")
    runs: dict[str, list[tuple[float, int]]] = {"cp": [], "streaming": [], "whole": []}
    for _ in range(args.repeats):  # interleaved: cp, streaming, whole, cp, ...
        shutil.rmtree(work / "copy", ignore_errors=True)
        runs["cp"].append(timed(f"cp -r {src} {work / 'copy'} && sync", shell=True))
        runs["streaming"].append(timed(import_cmd(src, work / "out-streaming", None)))
        runs["whole"].append(timed(import_cmd(src, work / "out-whole", WHOLE)))
    print(f"{'':10} {'wall s, median (min-max)':>26} {'x cp, paired':>22} {'peak RSS MiB':>24}")
    for name, values in runs.items():
        walls = [w for w, _ in values]
        ratios = [w / c for (w, _), (c, _) in zip(values, runs["cp"])]
        print(f"{name:10} {spread(walls):>26} {spread(ratios):>22} {spread([r / MiB for _, r in values]):>24}")
    if args.json:
        Path(args.json).write_text(json.dumps({"source_bytes": size, "tensors": args.tensors, "runs": runs,
                                               "machine": os.uname().nodename, "cpus": os.cpu_count(),
                                               "loadavg": os.getloadavg()}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
