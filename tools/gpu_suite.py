"""The GPU check: everything that only a CUDA machine can show, in one run, with one report.

    tools/dev.sh gpu              # on a CUDA machine: set up, run, write runs/gpu-<time>/{results.json,results.md}
    tools/dev.sh gpu --dry-run    # anywhere: print the plan (what would run, in order) and exit 0

On a machine without CUDA the plan is printed and nothing runs (exit 0). The steps:

1. environment: GPU name and memory, driver, torch/CUDA/NCCL versions (nvidia-smi, torch);
2. install: `pip install --no-index --no-build-isolation .` into the machine's own CUDA torch
   environment (no other torch pulled), then the installed package imported and its CLI run from
   outside the checkout;
3. readme: the README's "Five minutes" script, as a user copies it, under torchrun on the GPUs
   with the installed package: 6 steps, then resumed to 12, then `zeroshard verify` and
   `zeroshard consolidate` of what it saved;
4. sample: samples/train_gpt.py --device cuda (bf16, stage 3, checkpoints), resumed, then the
   checkpoint resharded to another world size and consolidated with the installed CLI; then with
   the memory tier (--memory-every): its newest memory checkpoint verified, the run relaunched;
5. GPU tests: tests/test_engine_gpu.py on NCCL (every stage's parity with a single-process run,
   bf16 at stage 3, offload_optimizer into pinned host memory) and the pinned host tier of
   parameter offload; pass/fail counts from JUnit XML;
6. step time: tools/bench_train.py --device cuda with a GPT-2-small-shape model (12L/768d; 86M
   parameters with the sample's character vocabulary) for DDP,
   FSDP2 (explicit prefetch) and zeroshard stages, bf16 and fp32, interleaved rounds, with
   each method's torch.cuda.max_memory_allocated; per stage, model-state bytes from
   engine.memory_report() and the peak CUDA allocation against `zeroshard estimate`'s formula;
7. checkpoint: tools/bench_checkpoint.py --device cuda on GPT-2 small with its state on the GPU:
   save, load (warm and cold), async save (blocked + copy-on-write) against raw I/O and DCP.

Each step runs under its own time limit (--step-timeout); one that overruns is killed with
everything it started and recorded as timed out. `--only` runs a subset of the steps.

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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from runnable_blocks import runnable_blocks  # noqa: E402  (shared with tests/test_readme.py)

GPT2_SMALL = ["--n-layer", "12", "--n-embd", "768", "--n-head", "12", "--block-size", "1024"]


@dataclass
class Step:
    name: str
    what: str
    argv: list[str]
    result_file: str | None = None  # where the step writes its figures (relative to the results folder)
    isolated: bool = False  # run without the checkout on PYTHONPATH (what a user's installed package sees)
    outcome: dict = field(default_factory=dict)


def plan(python: str, nproc: int, args: argparse.Namespace) -> list[Step]:
    """The steps, in order; `python` runs them (the interpreter whose torch sees the GPU)."""
    me = str(Path(__file__).resolve())
    bench = [python, str(REPO / "tools" / "bench_train.py"), "--device", "cuda", "--nproc", str(nproc),
             *GPT2_SMALL, "--batch", str(args.batch_per_gpu * nproc), "--steps", str(args.steps), "--warmup", "3",
             "--rounds", str(args.rounds), "--methods", args.methods]
    steps = [
        Step("environment", "GPU, driver, torch, CUDA and NCCL versions", [python, me, "--environment"]),
        Step("install", "pip install of the checkout into this CUDA environment; import and CLI from outside it",
             [python, me, "--install-check", "--nproc", str(nproc)], isolated=True),
        Step("readme", "the README's training snippet under torchrun on the GPUs (installed package), resumed; "
             "verify + consolidate", [python, me, "--readme-check", "--nproc", str(nproc)], isolated=True),
        Step("sample", "samples/train_gpt.py --device cuda, bf16 stage 3, resumed; reshard + consolidate",
             [python, me, "--sample-check", "--nproc", str(nproc)]),
        Step("gpu-tests", "tests/test_engine_gpu.py on NCCL: parity at stages 0-3, bf16, offload_optimizer; "
             "the pinned host tier of parameter offload",
             [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engine_gpu.py",
              "tests/test_engine_param_offload.py::test_host_tier_is_pinned_on_cuda",
              "--junitxml", "{out}/gpu-tests.xml"],
             "gpu-tests.xml"),
        *[Step(f"step-time-{dtype}",
               f"GPT-2-small shape (86M), {dtype}, batch {args.batch_per_gpu}/GPU: {args.methods}",
               [*bench, "--dtype", dtype, "--json", f"{{out}}/step-time-{dtype}.json"], f"step-time-{dtype}.json")
          for dtype in args.dtypes.split(",") if dtype],
        Step("checkpoint", "GPT-2 small (124M) + Adam on the GPU, stage 3: save/load/async vs raw I/O and DCP",
             [python, str(REPO / "tools" / "bench_checkpoint.py"), "--device", "cuda", "--nproc", str(nproc),
              "--n-layer", "12", "--n-embd", "768", "--n-head", "12", "--vocab", "50304", "--block-size", "1024",
              "--seq", "256", "--batch", "4", "--repeats", str(args.ckpt_repeats), "--warmup", "1",
              "--tune-runs", "2", "--loop-steps", "12", "--no-dcp-process", "--json", "{out}/checkpoint.json"],
             "checkpoint.json"),
    ]
    only = [n for n in args.only.split(",") if n] if args.only else None
    return [s for s in steps if only is None or s.name in only]


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


def run_step(step: Step, out: Path, timeout: float) -> None:
    argv = [a.replace("{out}", str(out)) for a in step.argv]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if not step.isolated:
        env["PYTHONPATH"] = str(REPO)
    t0 = time.perf_counter()
    with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True) as proc:  # its own group: a timeout kills torchrun's ranks too
        try:
            text, _ = proc.communicate(timeout=timeout)
            code: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            code = f"timed out after {timeout:.0f}s"
    step.outcome = {"command": shlex.join(argv), "exit": code, "seconds": time.perf_counter() - t0,
                    "output_tail": text[-4000:]}
    (out / f"{step.name}.log").write_text(text)
    if not step.result_file and code == 0:  # an in-file check prints its figures as the last line
        step.outcome["figures"] = json.loads(text.strip().splitlines()[-1])
    elif step.result_file and (out / step.result_file).exists():
        path = out / step.result_file
        if path.suffix == ".xml":
            step.outcome["figures"] = junit_counts(path)
        elif step.name.startswith("step-time"):
            bench = json.loads(path.read_text())
            step.outcome["figures"] = {"results": bench.get("results"), "memory": memory_rows(bench)}
        else:
            step.outcome["figures"] = json.loads(path.read_text())


def _run(argv: list[str], cwd: Path, env: dict | None = None, timeout: float = 600) -> str:
    """Run one command of a check; a failure raises with the command and its output's end."""
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       env={k: v for k, v in (env or os.environ).items() if k != "PYTHONPATH"})
    print(f"$ {shlex.join(argv)}  -> exit {r.returncode}\n{(r.stdout + r.stderr)[-1500:]}", flush=True)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {shlex.join(argv)}")
    return r.stdout


def _cli() -> str:
    """The installed `zeroshard` console script beside this interpreter."""
    cli = Path(sys.executable).parent / "zeroshard"
    if not cli.exists():  # e.g. `--only sample` without `install`
        raise SystemExit(f"no zeroshard command at {cli}: the install step puts it there (add it to --only)")
    return str(cli)


def _torchrun(nproc: int, script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
            *args]


def install_check(nproc: int) -> dict:
    """pip install the checkout with no index: every requirement must already be met by this
    environment, its CUDA torch included; then import and run it from a folder outside the checkout."""
    import torch

    before = torch.__version__
    _run([sys.executable, "-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-cache-dir",
          str(REPO)], REPO)
    with tempfile.TemporaryDirectory() as tmp:
        where = _run([sys.executable, "-c", "import zeroshard, torch; print(zeroshard.__file__); "
                      "print(torch.__version__, torch.cuda.is_available())"], Path(tmp)).split()
        version = _run([_cli(), "--version"], Path(tmp)).strip()
        _run([_cli(), "estimate", "--params", "124M", "--gpus", str(max(nproc, 8))], Path(tmp))
    if where[1] != before:
        raise SystemExit(f"pip replaced torch {before} with {where[1]}")
    if Path(where[0]).resolve().parent == REPO / "zeroshard":
        raise SystemExit(f"zeroshard imported from the checkout ({where[0]}), not the installed package")
    return {"zeroshard_file": where[0], "torch": where[1], "cuda": where[2], "version": version}


def readme_check(nproc: int) -> dict:
    """The README's torchrun snippet, copied as a user would, on the GPUs: 6 steps, then STEPS=12
    resumes it; the installed CLI then verifies and consolidates the checkpoint it left."""
    snippets = [code for _, ranks, code in runnable_blocks(REPO / "README.md") if ranks]
    if not snippets:
        raise SystemExit("README.md has no `runnable: torchrun` snippet")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "train.py").write_text(snippets[0])
        t0 = time.perf_counter()
        _run(_torchrun(nproc, "train.py"), cwd)
        first = time.perf_counter() - t0
        _run(_torchrun(nproc, "train.py"), cwd, env={**os.environ, "STEPS": "12"})
        verify = _run([_cli(), "verify", "ckpt"], cwd)
        _run([_cli(), "consolidate", "ckpt", "model.safetensors"], cwd)
        latest = (cwd / "ckpt" / "latest").read_text().strip()
        size = (cwd / "model.safetensors").stat().st_size
    return {"first_run_s": first, "latest": latest, "consolidated_bytes": size,
            "verify_tail": verify.strip().splitlines()[-1:]}


def sample_check(nproc: int, device: str = "cuda") -> dict:
    """samples/train_gpt.py on the GPUs (bf16, stage 3), resumed; the checkpoint resharded to
    another world size and consolidated (the toolkit needs no GPU; it runs here all the same)."""
    sample = str(REPO / "samples" / "train_gpt.py")
    model = ["--n-layer", "4", "--n-embd", "256", "--n-head", "8", "--block-size", "128", "--batch", "32"]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        ckpt = str(cwd / "gpt")
        common = ["--device", device, "--stage", "3", "--dtype", "bf16", "--ckpt", ckpt, "--save-every", "20",
                  "--log-every", "20", *model]
        out1 = _run(_torchrun(nproc, sample, *common, "--steps", "40"), cwd)
        out2 = _run(_torchrun(nproc, sample, *common, "--steps", "60", "--resume"), cwd)
        _run([_cli(), "reshard", ckpt, str(cwd / "gpt-4"), "--to", str(nproc * 4)], cwd)
        _run([_cli(), "verify", str(cwd / "gpt-4")], cwd)
        _run([_cli(), "consolidate", ckpt, str(cwd / "gpt.safetensors")], cwd)
        shutil.rmtree(cwd / "gpt-4")
        # the memory tier with GPU-resident state: memory checkpoints every 5 steps, drained every
        # 20; what it holds verifies, and the relaunch (same job: named by --ckpt) recovers
        tier = [*common, "--memory-every", "5", "--memory-dir", str(cwd / "shm")]
        tier[tier.index(ckpt)] = str(cwd / "gpt-tier")
        _run(_torchrun(nproc, sample, *tier, "--steps", "25"), cwd)
        held = sorted(str(m.parent) for m in (cwd / "shm").glob("*/*/zeroshard.json"))
        if not held:
            raise SystemExit(f"no committed memory checkpoint under {cwd / 'shm'}")
        _run([_cli(), "verify", held[-1]], cwd)
        out3 = _run(_torchrun(nproc, sample, *tier, "--steps", "30", "--resume"), cwd)

    def last(out: str, word: str) -> str:
        return next((ln for ln in reversed(out.splitlines()) if word in ln), "")
    return {"first": last(out1, "done:"), "resumed": last(out2, "resumed from"), "end": last(out2, "done:"),
            "losses": last(out2, "train loss"),
            "memory_tier": f"{len(held)} memory checkpoints, newest verified; " + last(out3, "recovered from")}


def markdown(steps: list[Step], header: str) -> str:
    lines = [f"# GPU run: {header}", "", "| step | exit | seconds | result |", "|---|---|---|---|"]
    for s in steps:
        fig = s.outcome.get("figures", {})
        if s.name == "gpu-tests" and fig:
            summary = (f"{fig['tests']} tests, {fig['failures']} failed, {fig['errors']} errors, "
                       f"{fig['skipped']} skipped")
        elif s.name == "environment" and fig:
            summary = f"{', '.join(fig['gpus'])}; torch {fig['torch']}, CUDA {fig['cuda']}, NCCL {fig['nccl']}"
        elif s.name == "checkpoint" and fig.get("ratios"):
            summary = "; ".join(f"{r['label']}: {r['median']:.2f}" for r in fig["ratios"].values())
        elif s.name in ("install", "readme", "sample") and fig:
            summary = "; ".join(f"{k}: {v}" for k, v in fig.items())
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit 0")
    p.add_argument("--python", default=sys.executable, help="the interpreter whose torch sees the GPU")
    p.add_argument("--nproc", type=int, default=0, help="ranks (default: the number of GPUs)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every step-time method")
    p.add_argument("--steps", type=int, default=20, help="timed steps per step-time run")
    p.add_argument("--batch-per-gpu", type=int, default=32,
                   help="step-time sequences (x 1024 tokens) per GPU: at 8, an H100 step of GPT-2 small is bound "
                        "by the host's kernel launches for every method (tools/results/gpu/profile_*), not by "
                        "compute and communication as issue 22's step targets assume")
    p.add_argument("--methods", default="ddp,fsdp2,zs0,zs1,zs2,zs3", help="step-time methods (bench_train.py)")
    p.add_argument("--dtypes", default="bf16,fp32", help="step-time precisions, in order")
    p.add_argument("--ckpt-repeats", type=int, default=5, help="measured repeats of the checkpoint benchmark")
    p.add_argument("--only", default="", help="comma-separated step names to run (default: all)")
    p.add_argument("--step-timeout", type=float, default=900, help="seconds each step may run")
    p.add_argument("--out", default=None, help="results folder (default: runs/gpu-<UTC time>)")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: try --sample-check without a GPU
    for mode in ("environment", "install-check", "readme-check", "sample-check"):
        p.add_argument(f"--{mode}", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.environment:
        print(json.dumps(environment()))
        return 0
    for mode, check in (("install_check", install_check), ("readme_check", readme_check),
                        ("sample_check", sample_check)):
        if getattr(args, mode):
            print(json.dumps(check(args.nproc or 1, **({"device": args.device} if mode == "sample_check" else {}))))
            return 0

    has_cuda, gpus = False, 0
    if not args.dry_run:
        probe = subprocess.run([args.python, "-c", "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True)
        gpus = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
        has_cuda = gpus > 0
    nproc = args.nproc or (gpus if has_cuda else 1)
    steps = plan(args.python, nproc, args)
    out = Path(args.out or REPO / "runs" / f"gpu-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}")
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
        run_step(s, out, args.step_timeout)
        print(f"[gpu] {s.name}: exit {s.outcome['exit']} in {s.outcome['seconds']:.0f}s", flush=True)
    header = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {nproc} rank(s)"
    (out / "results.json").write_text(json.dumps({"header": header, "steps": [
        {"name": s.name, "what": s.what, **s.outcome} for s in steps]}, indent=1))
    (out / "results.md").write_text(markdown(steps, header))
    print(f"[gpu] wrote {out}/results.json and results.md")
    return 1 if any(s.outcome.get("exit") != 0 for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
