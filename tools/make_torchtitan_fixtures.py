"""Generate tests/data/torchtitan: an interval checkpoint written by torchtitan 0.3.0's own
CheckpointManager (model, optimizer, lr_scheduler, dataloader, train_state), with its fused QKV.

Needs torchtitan 0.3.0 where `tools/dev.sh test --all` installs it (.venv/torchtitan-0.3.0, or
ZEROSHARD_TORCHTITAN_PATH):
    .venv/bin/python tools/make_torchtitan_fixtures.py [OUT_DIR]

Two gloo processes under torchrun (FSDP2, each block and the root sharded as torchtitan's
apply_fsdp does) train tests/torchtitan_model.py's shrunk llama3 with torchtitan's
OptimizersContainer (AdamW) and LRSchedulersContainer (the debug config's warmup-stable-decay);
CheckpointManager(interval=3) saves step-3 with everything, and the run goes on to step 6.
A fresh model (other weights) then resumes step-3 through CheckpointManager.load and trains
steps 4-6: torchtitan's own resume. Only step-3 is kept (the last step's model-only save is
tests/test_dcp_layouts.py's). reference_params.safetensors holds the parameters as the module
holds them at step 3 (wqkv fused), read from the live model; expected.json the losses (mean
over ranks) and the versions.

The dataloader is a stand-in with ParallelAwareDataloader.state_dict's layout (its rank's state
pickled under dp_rank_<rank>, and world_size): torchtitan's own needs torchdata.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
STEPS, INTERVAL = 6, 3


class TrainState:
    """torchtitan's Trainer as the `train_state` Stateful: exactly its state_dict."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


class Loader:
    """ParallelAwareDataloader.state_dict's layout: its rank's StatefulDataLoader state pickled."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.batches = rank, world, 0

    def state_dict(self) -> dict:
        return {f"dp_rank_{self.rank}": pickle.dumps({"_num_yielded": self.batches}), "world_size": self.world}

    def load_state_dict(self, state: dict) -> None:
        self.batches = pickle.loads(state[f"dp_rank_{self.rank}"])["_num_yielded"]


def worker(out: Path, phase: str) -> None:
    import torch.distributed as dist
    import torchtitan_model as tm
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    tm.import_torchtitan()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tm.make_model(0 if phase == "save" else 1)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer(tm.optimizer_config(), model_parts=[model])
    schedulers = tm.lr_schedulers(optimizers)
    train, loader = TrainState(), Loader(rank, world)
    ckpt = CheckpointManager(CheckpointManager.Config(enable=True, folder="checkpoint", interval=INTERVAL,
                                                      keep_latest_k=0, last_save_model_only=True),
                             dataloader=loader, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=schedulers, states={"train_state": train}, sd_adapter=None,
                             base_folder=str(out))
    if phase == "resume":
        assert ckpt.load(step=INTERVAL)
        assert train.step == INTERVAL and loader.batches == INTERVAL
    record: dict = {"losses": [], "lrs": [], "param_names": [n for n, _ in model.named_parameters()]}
    while train.step < STEPS:
        record["lrs"].append(optimizers.optimizers[0].param_groups[0]["lr"])
        loss = tm.loss_of(model, train.step, rank)
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train.step += 1
        train.ntokens_seen += tm.MICRO_BATCH * tm.SEQ * world
        loader.batches += 1
        record["losses"].append(tm.mean_over_ranks(loss))
        if phase == "save":
            ckpt.save(train.step, last_step=train.step == STEPS)
            if train.step == INTERVAL:
                full = {n: p.full_tensor().detach().clone().contiguous() for n, p in model.named_parameters()}
                if rank == 0:
                    from safetensors.torch import save_file

                    save_file(full, str(out / "reference_params.safetensors"))
    ckpt.close()
    if rank == 0:
        (out / f"{phase}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def make(out: Path) -> None:
    import torch
    import torchtitan_model as tm

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for phase in ("save", "resume"):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        "29521", str(Path(__file__).resolve()), "--worker", str(out), phase],
                       check=True, env=env, timeout=900)
    save, resume = (json.loads((out / f"{p}.json").read_text()) for p in ("save", "resume"))
    for phase in ("save", "resume"):
        (out / f"{phase}.json").unlink()
    for step in os.listdir(out / "checkpoint"):
        if step != f"step-{INTERVAL}":
            shutil.rmtree(out / "checkpoint" / step)
    expected = {
        "torchtitan_version": tm.VERSION, "torch_version": torch.__version__, "world_size": 2,
        "checkpoint": f"checkpoint/step-{INTERVAL}", "step": INTERVAL, "head_dim": tm.HEAD_DIM,
        "model": {"dim": tm.DIM, "n_heads": tm.N_HEADS, "n_kv_heads": tm.N_KV_HEADS, "n_layers": tm.N_LAYERS,
                  "vocab_size": tm.VOCAB},
        "param_names": save["param_names"],
        "losses_before": save["losses"][:INTERVAL], "losses_after": save["losses"][INTERVAL:],
        "losses_resumed": resume["losses"], "lrs_after": save["lrs"][INTERVAL:], "lrs_resumed": resume["lrs"],
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(out, json.dumps(expected))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]), sys.argv[3])
        return
    make(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "torchtitan" / "interval")


if __name__ == "__main__":
    main()
