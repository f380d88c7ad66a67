"""The GPU check: everything that only a CUDA machine can show, in one run, with one report.

    tools/dev.sh gpu              # on a CUDA machine: set up, run, write runs/gpu-<time>/{results.json,results.md}
    tools/dev.sh gpu --dry-run    # anywhere: print the plan (what would run, in order) and exit 0

On a machine without CUDA the plan is printed and nothing runs (exit 0). The steps:

1. environment: GPU name and memory, driver, torch/CUDA/NCCL versions (nvidia-smi, torch);
2. GPU tests: tests/test_engine_gpu.py on NCCL (every stage's parity with a single-process run,
   bf16 at stage 3, offload_optimizer into pinned host memory); pass/fail counts from JUnit XML;
3. step time: tools/bench_train.py --device cuda with a GPT-2-small-size model (124M) for DDP,
   FSDP2 (explicit prefetch) and zeroshard stages 0-3, fp32 and bf16, interleaved rounds, with
   each method's torch.cuda.max_memory_allocated;
4. memory: per stage, model-state bytes from engine.memory_report() and the peak CUDA allocation
   against `zeroshard estimate`'s formula for the same parameter count and world size.

Every step's outcome (command, exit code, seconds, parsed figures) goes into results.json; the
Markdown table is made from that JSON. A failed step is recorded and the next one still runs;
the exit code is non-zero if any step failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT2_SMALL = ["--n-layer", "12", "--n-embd", "768", "--n-head", "12", "--block-size", "1024"]


@dataclass
class Step:
    name: str
    what: str
    argv: list[str]
    result_file: str | None = None  # where the step writes its figures (relative to the results folder)
    outcome: dict = field(default_factory=dict)


def plan(python: str, nproc: int, rounds: int) -> list[Step]:
    """The steps, in order; `python` runs them (the interpreter whose torch sees the GPU)."""
    bench = [python, str(REPO / "tools" / "bench_train.py"), "--device", "cuda", "--nproc", str(nproc),
             *GPT2_SMALL, "--batch", str(8 * nproc), "--steps", "20", "--warmup", "3", "--rounds", str(rounds),
             "--methods", "ddp,fsdp2,zs0,zs1,zs2,zs3"]
    return [
        Step("environment", "GPU, driver, torch, CUDA and NCCL versions",
             [python, str(Path(__file__).resolve()), "--environment"]),
        Step("gpu-tests", "tests/test_engine_gpu.py on NCCL: parity at stages 0-3, bf16, offload_optimizer",
             [python, "-m", "pytest", "-q", "-m", "gpu", "tests/test_engine_gpu.py",
              "--junitxml", "{out}/gpu-tests.xml"],
             "gpu-tests.xml"),
        Step("step-time-fp32", "GPT-2 small (124M), fp32: DDP, FSDP2 (prefetch), zeroshard 0-3",
             [*bench, "--dtype", "fp32", "--json", "{out}/step-time-fp32.json"], "step-time-fp32.json"),
        Step("step-time-bf16", "GPT-2 small (124M), bf16: DDP, FSDP2 (prefetch), zeroshard 0-3",
             [*bench, "--dtype", "bf16", "--json", "{out}/step-time-bf16.json"], "step-time-bf16.json"),
    ]


def environment() -> dict:
    """What the GPU run ran on (printed as JSON by the `environment` step)."""
    import torch

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "nvidia_smi": smi.stdout.strip().splitlines()}


def junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def memory_rows(bench: dict) -> list[dict]:
    """Per zeroshard stage: memory_report()'s model state and the CUDA peak against the formula."""
    from zeroshard.estimate import model_state_bytes

    rows = []
    for r in bench.get("results", []):
        if not r.get("method", "").startswith("zs") or "error" in r:
            continue
        stage, world = int(r["method"][2:]), r["world_size"]
        dtype = bench["args"]["dtype"]
        formula = model_state_bytes(r["n_params"], world, stage, dtype).total
        rows.append({"stage": stage, "dtype": dtype, "world_size": world,
                     "memory_report_bytes": r["peak_memory"][0]["total"],
                     "cuda_max_allocated": r.get("cuda_max_allocated"), "formula_bytes": formula})
    return rows


def run_step(step: Step, out: Path) -> None:
    argv = [a.replace("{out}", str(out)) for a in step.argv]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    step.outcome = {"command": shlex.join(argv), "exit": proc.returncode, "seconds": time.perf_counter() - t0,
                    "output_tail": (proc.stdout + proc.stderr)[-4000:]}
    (out / f"{step.name}.log").write_text(proc.stdout + proc.stderr)
    if step.name == "environment" and proc.returncode == 0:
        step.outcome["figures"] = json.loads(proc.stdout.strip().splitlines()[-1])
    elif step.result_file and (out / step.result_file).exists():
        path = out / step.result_file
        if path.suffix == ".xml":
            step.outcome["figures"] = junit_counts(path)
        else:
            bench = json.loads(path.read_text())
            step.outcome["figures"] = {"results": bench.get("results"), "memory": memory_rows(bench)}


def markdown(steps: list[Step], header: str) -> str:
    lines = [f"# GPU run: {header}", "", "| step | exit | seconds | result |", "|---|---|---|---|"]
    for s in steps:
        fig = s.outcome.get("figures", {})
        if s.name == "gpu-tests" and fig:
            summary = (f"{fig['tests']} tests, {fig['failures']} failed, {fig['errors']} errors, "
                       f"{fig['skipped']} skipped")
        elif s.name == "environment" and fig:
            summary = f"{', '.join(fig['gpus'])}; torch {fig['torch']}, CUDA {fig['cuda']}, NCCL {fig['nccl']}"
        else:
            summary = s.what
        lines.append(f"| {s.name} | {s.outcome.get('exit', '-')} | {s.outcome.get('seconds', 0):.0f} | {summary} |")
    for s in steps:
        results = s.outcome.get("figures", {}).get("results") if s.name.startswith("step-time") else None
        if not results:
            continue
        base = next((r for r in results if r.get("method") == "ddp" and "error" not in r), None)
        lines += ["", f"## {s.name}: {s.what}", "", "| method | step ms (median) | x DDP | CUDA peak MiB |",
                  "|---|---|---|---|"]
        for r in results:
            if "error" in r:
                lines.append(f"| {r['method']} | {r['error']} | | |")
                continue
            ratio = f"{r['step_ms'] / base['step_ms']:.2f}" if base else "-"
            peak = f"{r['cuda_max_allocated'] / 2**20:.0f}" if r.get("cuda_max_allocated") else "-"
            lines.append(f"| {r['method']} | {r['step_ms']:.1f} | {ratio} | {peak} |")
        memory = s.outcome["figures"].get("memory") or []
        if memory:
            lines += ["", "| stage | memory_report MiB | CUDA peak MiB | formula MiB |", "|---|---|---|---|"]
            for m in memory:
                peak = f"{m['cuda_max_allocated'] / 2**20:.0f}" if m["cuda_max_allocated"] else "-"
                lines.append(f"| {m['stage']} | {m['memory_report_bytes'] / 2**20:.0f} | {peak} | "
                             f"{m['formula_bytes'] / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit 0")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose torch sees the GPU")
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: the number of GPUs)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every step-time method")
    p.add_argument("--out", default=None, help="results folder (default: runs/gpu-<UTC time>)")
    p.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.environment:
        print(json.dumps(environment()))
        return 0

    has_cuda, gpus = False, 0
    if not args.dry_run:
        probe = subprocess.run([args.python, "-c", "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True)
        gpus = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
        has_cuda = gpus > 0
    nproc = args.nproc or (gpus if has_cuda else 1)
    steps = plan(args.python, nproc, args.rounds)
    out = Path(args.out or REPO / "runs" / f"gpu-{datetime.datetime.utcnow():%Y%m%d-%H%M%S}")
    if args.dry_run or not has_cuda:
        why = "dry run" if args.dry_run else f"no CUDA device visible to {args.python}"
        print(f"zeroshard GPU check: {why}; this is what would run, in order, writing into {out}/:")
        for i, s in enumerate(steps, 1):
            print(f"  {i}. {s.name}: {s.what}\n     $ {shlex.join(a.replace('{out}', str(out)) for a in s.argv)}")
        print("  then results.json (every step's command, exit code, seconds and figures) and results.md")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    for s in steps:
        print(f"[gpu] {s.name}: {s.what} ...", flush=True)
        run_step(s, out)
        print(f"[gpu] {s.name}: exit {s.outcome['exit']} in {s.outcome['seconds']:.0f}s", flush=True)
    header = f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {nproc} rank(s)"
    (out / "results.json").write_text(json.dumps({"header": header, "steps": [
        {"name": s.name, "what": s.what, **s.outcome} for s in steps]}, indent=1))
    (out / "results.md").write_text(markdown(steps, header))
    print(f"[gpu] wrote {out}/results.json and results.md")
    return 1 if any(s.outcome.get("exit") for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
