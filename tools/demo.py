"""The main job: the sample GPT trained with ZeRO-3 on 2 CPU ranks with checkpoints, resharded
offline to 4 ranks, resumed on 4 ranks, consolidated, and loaded into a plain model that
generates a few lines. Run through `tools/dev.sh demo` (which sets up the environment).

    python tools/demo.py [--out runs/demo] [--steps 80] [--resume-steps 140]
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
BIN = Path(sys.executable).parent


def say(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def run(*cmd: str) -> None:
    print("$ " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=600)


def torchrun(ranks: int, *args: str) -> None:
    run(str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", "samples/train_gpt.py", *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo", help="working folder (replaced)")
    parser.add_argument("--steps", type=int, default=300, help="steps trained on 2 ranks")
    parser.add_argument("--resume-steps", type=int, default=400, help="total steps after resuming on 4 ranks")
    args = parser.parse_args()
    out = ROOT / args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ckpt2, ckpt4 = out / "ckpt-2ranks", out / "ckpt-4ranks"
    zeroshard = str(BIN / "zeroshard")
    model = ["--n-layer", "3", "--n-embd", "96", "--n-head", "4", "--block-size", "64", "--batch", "16",
             "--log-every", "50"]
    started = time.time()

    say(f"1/6 train the sample GPT with ZeRO stage 3 on 2 CPU ranks for {args.steps} steps, "
        f"checkpointing every {args.steps // 2}")
    torchrun(2, "--stage", "3", "--steps", str(args.steps), "--save-every", str(args.steps // 2),
             "--ckpt", str(ckpt2), *model)

    say("2/6 what was saved: inspect and verify the checkpoint (no GPU, no process group)")
    run(zeroshard, "inspect", str(ckpt2))
    run(zeroshard, "verify", "-q", str(ckpt2))

    say("3/6 reshard it offline from 2 to 4 ranks (optimizer state included)")
    run(zeroshard, "reshard", "-q", str(ckpt2), "--to", "4", "-o", str(ckpt4))
    shutil.copy(ckpt2 / "model_config.json", ckpt4 / "model_config.json")

    say(f"4/6 resume on 4 ranks (ZeRO stage 3) and continue to step {args.resume_steps}")
    torchrun(4, "--stage", "3", "--steps", str(args.resume_steps), "--ckpt", str(ckpt4), "--resume", *model)

    say("5/6 consolidate the final checkpoint into one safetensors file")
    weights = out / "model.safetensors"
    run(zeroshard, "consolidate", "-q", str(ckpt4), str(weights))

    say("6/6 load it into a plain nn.Module (strict) and generate")
    run(sys.executable, "samples/generate.py", str(weights), "--config", str(ckpt4 / "model_config.json"))
    print(f"\ndone in {time.time() - started:.0f}s; everything is in {out}")


if __name__ == "__main__":
    main()
