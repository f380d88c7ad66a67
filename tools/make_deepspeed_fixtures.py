"""Generate the small real DeepSpeed checkpoints under tests/data/deepspeed (stages 1, 2, 3).

Needs DeepSpeed (CPU build is enough):
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu .venv/bin/pip install -c tools/constraints.txt --no-build-isolation deepspeed
    DS_ACCELERATOR=cpu .venv/bin/python tools/make_deepspeed_fixtures.py [OUT_DIR]

For each stage, 2 gloo ranks train tests/interop_model.py's TinyTied with DeepSpeed for
STEPS_BEFORE steps, save (tag global_step3, with a client state), train STEPS_AFTER more, and
then a fresh DeepSpeed engine (different initial weights) loads the checkpoint and trains the
same STEPS_AFTER steps: DeepSpeed's own resume. expected.json records all three loss
sequences (mean over ranks), so tests can check that zeroshard resumed from an import
continues exactly as DeepSpeed does, without DeepSpeed installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from interop_model import MICRO_BATCH, batch, make_model, make_optimizer  # noqa: E402

WORLD, STEPS_BEFORE, STEPS_AFTER = 2, 3, 3
TAG = f"global_step{STEPS_BEFORE}"


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}


def _train(engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        tokens, targets = batch(step, dist.get_rank())
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _rank(rank: int, port: int, stage: int, out: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu"})
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model.parameters()),
                                      config=ds_config(stage))
    before = _train(engine, range(STEPS_BEFORE))
    engine.save_checkpoint(out, tag=TAG, client_state={"epoch": 1, "note": "fixture"})
    after = _train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))

    model = make_model(1)  # different weights: the load must overwrite every one
    fresh, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model.parameters()),
                                     config=ds_config(stage))
    _, client = fresh.load_checkpoint(out)
    resumed = _train(fresh, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    if rank == 0:
        expected = {"stage": stage, "world_size": WORLD, "tag": TAG, "deepspeed_version": deepspeed.__version__,
                    "torch_version": torch.__version__, "losses_before": before, "losses_after": after,
                    "losses_resumed": resumed, "client_state": {k: client[k] for k in ("epoch", "note")}}
        Path(out, "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "tests" / "data" / "deepspeed")
    for stage in (1, 2, 3):
        out = root / f"stage{stage}"
        shutil.rmtree(out, ignore_errors=True)
        mp.spawn(_rank, args=(_free_port(), stage, str(out)), nprocs=WORLD)
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed copies its own script beside saves
            (out / script).unlink(missing_ok=True)
        print(out, json.loads((out / "expected.json").read_text()))


if __name__ == "__main__":
    main()
