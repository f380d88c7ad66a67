"""Regenerate tests/data/deepspeed_examples/: per-step losses of the DeepSpeed example scripts
(samples/gpt_pretrain_deepspeed.py, samples/bert_mlm_deepspeed.py, samples/sft_deepspeed_chat.py)
under real DeepSpeed, at world 2 on gloo, ZeRO stages 1-3, a fresh run that saves and a run that
resumes from it.

    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu .venv/bin/pip install -c tools/constraints.txt --no-build-isolation deepspeed
    .venv/bin/python tools/make_deepspeed_example_references.py [OUT_DIR [NAME ...]]   # NAME: only those

tests/test_deepspeed_examples.py runs the same scripts on zeroshard.deepspeed (only the import
changed, by samples/run_script.py) and compares with these files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = (1, 2, 3)
WORLD = 2
# script -> (its file, the arguments of the run that saves, those of the run that resumes)
EXAMPLES = {
    "gpt_pretrain": ("samples/gpt_pretrain_deepspeed.py", ["--save-dir", "{ckpt}"], ["--load-dir", "{ckpt}"]),
    "bert_mlm": ("samples/bert_mlm_deepspeed.py", ["--save-dir", "{ckpt}"], ["--load-dir", "{ckpt}"]),
    # "resumed" here is DeepSpeed-Chat's next step: a new run from the pytorch_model.bin it saved
    "sft_deepspeed_chat": ("samples/sft_deepspeed_chat.py", ["--save-dir", "{ckpt}"], ["--load-dir", "{ckpt}"]),
}


def run_example(name: str, library: str, work: Path, port: int, timeout: float = 600) -> dict:
    """Launch the example once for all stages (fresh, then resumed, per stage); return
    {"stage<N>": {"fresh": [per-rank losses], "resumed": [...]}}."""
    script, save, load = EXAMPLES[name]
    args: list[str] = []
    for stage in STAGES:
        ckpt = str(work / f"ckpt-{stage}")
        for kind, extra in (("fresh", save), ("resumed", load)):
            args += [*(["---"] if args else []), "--zero-stage", str(stage), "--out", str(work / f"{kind}-{stage}"),
                     *[a.format(ckpt=ckpt) for a in extra]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port", str(port),
           str(ROOT / "samples" / "run_script.py"), "--library", library, str(ROOT / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=work)
    if proc.returncode != 0:
        # gloo's one "connected to N peer ranks" line per group and rank would push the error out of view
        said = [line for line in (proc.stdout + proc.stderr).splitlines() if "Expected number of connected" not in line]
        raise RuntimeError(f"{name} on {library} failed:\n" + "\n".join(said)[-6000:])
    out = {}
    for stage in STAGES:
        out[f"stage{stage}"] = {kind: [json.loads((work / f"{kind}-{stage}" / f"losses-rank{r}.json").read_text())
                                       ["losses"] for r in range(WORLD)] for kind in ("fresh", "resumed")}
    return out


def main() -> None:
    import deepspeed

    target = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "tests" / "data" / "deepspeed_examples")
    target.mkdir(parents=True, exist_ok=True)
    names = sys.argv[2:] or list(EXAMPLES)
    for i, name in enumerate(names):
        with tempfile.TemporaryDirectory() as work:
            losses = run_example(name, "deepspeed", Path(work), 29731 + i)
        record = {"script": EXAMPLES[name][0], "world_size": WORLD, "deepspeed_version": deepspeed.__version__,
                  "losses": losses}
        (target / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {target / f'{name}.json'}")


if __name__ == "__main__":
    main()
