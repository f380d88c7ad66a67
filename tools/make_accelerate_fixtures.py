"""Generate tests/data/accelerate_plain: real Accelerate `save_state` folders without FSDP or
DeepSpeed (model.safetensors, optimizer.bin, scheduler.bin, random_states_*.pkl, ...).

Needs Accelerate 1.15.0 (installed by `tools/dev.sh test --all`'s set-up, or in its own folder on
PYTHONPATH: `pip install --no-deps --target DIR accelerate==1.15.0`):
    .venv/bin/python tools/make_accelerate_fixtures.py [OUT_DIR [VARIANT ...]]

Each variant trains tests/interop_model.py's TinyTied with AdamW and a LambdaLR warmup prepared
by an `Accelerator` for steps 0-2, calls `save_state`, trains steps 3-5; then a fresh model
(other weights) is prepared the same way, `load_state` restores the folder and trains steps 3-5:
Accelerate's own resume. expected.json records the losses (the mean over ranks) and the tool
versions, so the tests check an engine resumed from the import without Accelerate installed.

Variants: single (one process, `AdamW(model.parameters())`: optimizer.bin numbers the
parameters in that order and names none; an object registered for checkpointing rides along as
custom_checkpoint_0.pkl); ddp_named (2 gloo processes under torchrun, DDP; the two param groups
built from `named_parameters()`, so torch records each group's `param_names`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
VARIANTS = {"single": {"world_size": 1, "named": False}, "ddp_named": {"world_size": 2, "named": True}}
ACCELERATE_VERSION = "1.15.0"
FOLDER = "checkpoint"
BEFORE, AFTER = (0, 1, 2), (3, 4, 5)


class Counter:
    """An object a script registers with `register_for_checkpointing` (a data position)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def _train(accelerator, model, optimizer, scheduler, steps, counter=None) -> list[float]:
    from interop_model import batch

    losses = []
    for step in steps:
        tokens, targets = batch(step, accelerator.process_index)
        loss = model(tokens, targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        if counter is not None:
            counter.seen += 1
    return losses


def worker(variant: str, out: Path, phase: str) -> None:
    """One process of a run: `save` (steps 0-2, save_state, steps 3-5) or `resume`."""
    import accelerate
    import torch

    from interop_model import BETAS, LR, WEIGHT_DECAY, make_model, warmup

    assert accelerate.__version__ == ACCELERATE_VERSION, accelerate.__version__
    accelerator = accelerate.Accelerator(cpu=True)
    model = make_model(0 if phase == "save" else 1)
    if VARIANTS[variant]["named"]:
        decay = ("emb.weight", "fc.weight")
        groups = [{"params": [(n, p) for n, p in model.named_parameters() if n in decay]},
                  {"params": [(n, p) for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = None
    if not VARIANTS[variant]["named"]:
        counter = Counter()
        accelerator.register_for_checkpointing(counter)
    record: dict = {}
    if phase == "save":
        record["losses_before"] = _train(accelerator, model, optimizer, scheduler, BEFORE, counter)
        accelerator.save_state(str(out / FOLDER))
        record["losses_after"] = _train(accelerator, model, optimizer, scheduler, AFTER, counter)
    else:
        accelerator.load_state(str(out / FOLDER))
        record["losses_resumed"] = _train(accelerator, model, optimizer, scheduler, AFTER, counter)
        record["counter_resumed"] = counter.seen if counter is not None else None
    if accelerator.is_main_process:
        (out / f"{phase}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def make(variant: str, out: Path) -> None:
    import accelerate
    import torch

    world = VARIANTS[variant]["world_size"]
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for phase in ("save", "resume"):
        me = [str(Path(__file__).resolve()), "--worker", variant, str(out), phase]
        if world == 1:
            command = [sys.executable, *me]
        else:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                       "--master-port", "29517", *me]
        subprocess.run(command, check=True, env=env, timeout=600)
    save, resume = (json.loads((out / f"{p}.json").read_text()) for p in ("save", "resume"))
    for phase in ("save", "resume"):
        (out / f"{phase}.json").unlink()
    expected = {"variant": variant, "world_size": world, "folder": FOLDER, "accelerate_version": accelerate.__version__,
                "torch_version": torch.__version__, **save, **resume,
                "scheduler_steps_per_step": world}  # AcceleratedScheduler steps once per process
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(out, expected)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], Path(sys.argv[3]), sys.argv[4])
        return
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "accelerate_plain"
    for variant in sys.argv[2:] or list(VARIANTS):
        make(variant, out / variant)


if __name__ == "__main__":
    main()
