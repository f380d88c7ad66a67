"""Benchmark the toolkit against plain tools doing the same I/O, measured in the same run.

    python tools/bench_toolkit.py                  # 64M params + AdamW (0.77 GB), 10 repeats, ~2 min
    python tools/bench_toolkit.py --params 340M    # ~4.1 GB (quiet machine only)

Builds a synthetic LLM-shaped checkpoint (embedding + transformer blocks) with AdamW state
(fp32 weights, exp_avg, exp_avg_sq, step) over 4 ranks, then times, each as its own process and
interleaved with its baseline (tools/benchlib.py: one warm-up, then --repeat repeats):

- consolidate (weights only) vs `cp` of a file of the consolidated size + `sync`, -j 1 and 2,
- reshard 4 -> 16 and 4 -> 3 vs `cp -r` of the whole checkpoint + `sync`,
- verify (reads and hashes everything) vs `cat` of the whole checkpoint to /dev/null,

and reports the median and IQR of the paired ratios (target <= 1.3x), CPU-second ratios, and each
command's peak RSS against the largest tensor + 512 MiB. A third side in each repeat starts the
interpreter and imports what the command imports, then stops: its time against the baseline's
is the part of a miss that is fixed cost, whatever the checkpoint's size. zeroshard fsyncs every
file it commits, so the copies are synced too. Page cache is warm for both sides. Raw JSON:
tools/results/bench_toolkit.json (--json PATH elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench_env import use_compiled_bytecode  # tools/, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402  (tools/, beside this script)

# The measuring process imports nothing heavy: a child's peak RSS as the kernel reports it
# (wait4's ru_maxrss) includes what the parent held when it forked that child.
ROOT = Path(__file__).resolve().parents[1]


def parse_count(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}
    return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].upper() in scale else int(text)


def model_shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """An LLM-like set of shapes with about `params` parameters (hidden 1024, vocab 50304)."""
    hidden, vocab = 1024, 50304
    shapes = [("embed.weight", (vocab, hidden))]
    per_block = 4 * hidden * hidden + 2 * 4 * hidden * hidden + 4 * hidden
    blocks = max(1, (params - vocab * hidden) // per_block)
    for b in range(blocks):
        p = f"blocks.{b}."
        shapes += [(p + "attn.qkv.weight", (3 * hidden, hidden)), (p + "attn.proj.weight", (hidden, hidden)),
                   (p + "mlp.up.weight", (4 * hidden, hidden)), (p + "mlp.down.weight", (hidden, 4 * hidden)),
                   (p + "ln1.weight", (hidden,)), (p + "ln1.bias", (hidden,)),
                   (p + "ln2.weight", (hidden,)), (p + "ln2.bias", (hidden,))]
    shapes.append(("norm.weight", (hidden,)))
    return shapes


def noise_fill():
    """A format-writer fill callback writing random bytes for fp32 fragments (one 16 MiB buffer,
    reused: content does not change I/O or hashing speed)."""
    noise = memoryview(os.urandom(16 * 1024 * 1024))

    def fill(spec, start, end, write):
        remaining = (end - start) * 4
        while remaining:
            n = min(remaining, len(noise))
            write(noise[:n])
            remaining -= n

    return fill


def build_checkpoint(path: Path, params: int, world_size: int) -> tuple[int, int, int]:
    """Write the synthetic checkpoint; returns (parameter count, total bytes, largest tensor bytes)."""
    from zeroshard.format import (
        TensorSpec,
        build_manifest,
        rank_contents,
        write_rank_file,
    )
    from zeroshard.format.output import prepare_output
    from zeroshard.storage import Location

    specs = []
    for name, shape in model_shapes(params):
        specs.append(TensorSpec(name, "param", "F32", shape))
        for state in ("exp_avg", "exp_avg_sq"):
            specs.append(TensorSpec(f"optimizer/{state}/{name}", "optimizer", "F32", shape, param=name, state=state))
        specs.append(TensorSpec(f"optimizer/step/{name}", "optimizer", "F32", (), "whole", param=name, state="step"))
    fill = noise_fill()

    location = Location(str(path))
    output = prepare_output(location, overwrite=True)  # the old one is kept until the new one commits
    checkpoint_id = uuid.uuid4().hex
    try:
        results = [write_rank_file(output.stage, checkpoint_id, r, world_size, rank_contents(specs, world_size, r),
                                   fill) for r in range(world_size)]
    except BaseException:
        output.abandon()
        raise
    manifest = build_manifest(specs, world_size, results, checkpoint_id, zero_stage=3, step=1000,
                              optimizer={"class": "torch.optim.AdamW", "param_groups": [{"lr": 3e-4}]})
    output.commit_checkpoint(manifest)
    n_params = sum(s.numel for s in specs if s.role == "param")
    return n_params, sum(f.size for f in manifest.files), max(s.numel * 4 for s in specs)


def timed(cmd: list[str] | str, shell: bool = False) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (bytes) and CPU seconds (user + system) of one child process (and
    its children: cp, sync). The disk's writeback runs in the kernel's own threads and counts in
    neither side's CPU time."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {cmd}\n{proc.stderr.read().decode()}")
    return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def zeroshard(*args: str) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli", *args, "-q"]


def own_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="50M", help="model size (at least the 51M-param embedding; 340M: ~4.1 GB)")
    parser.add_argument("--dir", default="/tmp/zs-bench", help="scratch folder (needs ~3x the checkpoint size)")
    parser.add_argument("--repeat", type=int, default=10, help="interleaved repeats after one warm-up")
    parser.add_argument("--workers", default="1,2", help="comma-separated -j values for consolidate")
    parser.add_argument("--json", default=None, help="result file (default tools/results/bench_toolkit.json)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--build-only", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_compiled_bytecode()
    if args.build_only:
        print(json.dumps(build_checkpoint(Path(args.build_only), parse_count(args.params), 4)))
        return
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt = work / "ckpt"
    built = subprocess.run([sys.executable, __file__, "--build-only", str(ckpt), "--params", args.params],
                           check=True, capture_output=True, text=True, cwd=ROOT)
    n_params, total, largest = json.loads(built.stdout)
    rep = benchlib.Report("bench_toolkit", vars(args), scope=(
        f"CPU, {benchlib.machine()['cores']} vCPUs, {n_params / 1e6:.0f}M params + AdamW state over 4 ranks = "
        f"{total / 1e9:.2f} GB, local write-cached virtual disk, warm page cache, each command a process"))
    print(f"checkpoint: {n_params / 1e6:.0f}M params with AdamW state, 4 ranks, {total / 1e9:.2f} GB "
          f"(largest tensor {largest / 2**20:.0f} MiB)")

    def rm(*paths):
        def clean(_name: str = "") -> None:
            for p in paths:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            subprocess.run("sync", shell=True)
        return clean

    rss: dict[str, int] = {}
    cpu: dict[str, list[float]] = {}

    def side(key, cmd):
        def run() -> float:
            wall, peak, used = timed(cmd, shell=isinstance(cmd, str))
            rss[key] = max(rss.get(key, 0), peak)
            cpu.setdefault(key, []).append(used)
            return wall
        return run

    out, copy = work / "model.safetensors", work / "copy"
    subprocess.run(zeroshard("consolidate", str(ckpt), str(out)), check=True)
    same = work / "same.bin"
    shutil.copyfile(out, same)
    # (name, our command, baseline, baseline label, files to delete before every run)
    groups = [(f"consolidate_j{j}", f"consolidate (weights) -j {j}",
               zeroshard("consolidate", str(ckpt), str(out), "-j", j),
               f"cp {same} {copy} && sync {copy}", "cp of a file of the same size + sync", (out, copy))
              for j in args.workers.split(",")]
    for to in (16, 3):
        target = work / f"w{to}"
        groups.append((f"reshard_4_{to}", f"reshard 4 -> {to}",
                       zeroshard("reshard", str(ckpt), "--to", str(to), "-o", str(target), "--overwrite"),
                       f"cp -r {ckpt} {copy} && sync {copy}/*", "cp -r + sync", (target, copy)))
    groups.append(("verify", "verify (read + hash all)", zeroshard("verify", str(ckpt)),
                   f"cat {ckpt}/*.safetensors > /dev/null", "cat > /dev/null", ()))
    limit = largest + 512 * 2**20
    for key, label, ours, base, base_label, outputs in groups:
        # the third side starts the interpreter and imports what the command imports, and stops:
        # the share of the command's time that is fixed cost, whatever the checkpoint's size
        start = benchlib.start_up_command(key.split("_")[0])
        runs = benchlib.interleave({key: side(key, ours), f"{key}_base": side(f"{key}_base", base),
                                    f"{key}_start_up": side(f"{key}_start_up", start)},
                                   args.repeat, warmup=1, before_each=rm(*outputs))
        rep.runs(key, runs[key], f"zeroshard {label}")
        rep.runs(f"{key}_base", runs[f"{key}_base"], f"{base_label} (baseline of {label})")
        rep.runs(f"{key}_start_up", runs[f"{key}_start_up"], f"{label}: interpreter + imports alone")
        rep.ratio(f"{key}_vs_base", key, f"{key}_base", f"{label} / {base_label}", "<= 1.3")
        rep.ratio(f"{key}_start_up_vs_base", f"{key}_start_up", f"{key}_base",
                  f"{label}: interpreter + imports alone / {base_label}")
        rep.value(f"{key}_rss_MiB", rss[key] / 2**20, "MiB", f"{label}: peak RSS", f"<= {limit / 2**20:.0f}")
        rep.ratio_values(f"{key}_cpu_vs_base", benchlib.paired_ratios(cpu[key][1:], cpu[f"{key}_base"][1:]),
                         f"{label}: CPU seconds / baseline's")
    rep.note(f"peak RSS of a child includes the {own_rss() / 2**20:.0f} MiB of the measuring process at fork; "
             f"RSS target: largest tensor ({largest / 2**20:.0f} MiB) + 512 MiB")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    path = rep.finish(args.json)
    print("\n" + rep.table() + "\n\n" + "\n".join(rep.data["notes"]) + f"\n\nraw JSON: {path}")


if __name__ == "__main__":
    main()
