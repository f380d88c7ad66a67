"""Generate the small DCP checkpoints under tests/data/dcp, each written by an older torch.

Users arrive with DCP checkpoints written by the torch their FSDP job ran, often older than the
torch they run zeroshard on. This writes the layouts tests/test_dcp_layouts.py covers live (with
the CI's torch) under another torch, from a venv of its own (torch's CUDA build from PyPI runs on
the CPU; about 5.5 GB a venv):

    python3 -m venv /tmp/t24 && /tmp/t24/bin/pip install torch==2.4.1 safetensors
    /tmp/t24/bin/python tools/make_dcp_fixtures.py [OUT_DIR]     # OUT_DIR/torch-2.4.1/...

2 gloo ranks train tests/interop_model.py's TinyTied with DDP and torch's AdamW for 3 steps, save
with `dcp.save` in four layouts, and train 3 more steps. expected.json records the losses of those
3 steps (mean over ranks), so a resume of the import can be checked against the run's own
continuation with no old torch installed; expected.safetensors the values saved, as that torch
held them (`param/NAME`, `buffer/NAME`, `state/NAME/exp_avg`, `state/NAME/exp_avg_sq`), for a
bit-exact check of what the import read.

Layouts, each under "model" plus the optimizer's key, as `get_state_dict(ddp_model, optimizer)`
gives them: `flattened` (`flatten_optimizer_state_dict=True` under "optim": torchtitan's choice),
`optimizer_key` (the nested optimizer state dict under "optimizer": Accelerate's and many repos'
key), `plain` (`dcp.save(model_state_dict)`, weights only), and `sharded`: the `optimizer_key`
state with every weight and moment a DTensor sharded on dim 0 across the 2 ranks, as FSDP2's state
dicts are. FSDP2 itself needs CUDA streams before torch 2.7 (2.4-2.6 fail on the CPU), so these
DTensors come from `distribute_tensor` of the DDP run's state: the chunk metadata and files are
DCP's own, written by that torch.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from interop_model import batch, make_model, make_optimizer  # noqa: E402

WORLD, STEPS_BEFORE, STEPS_AFTER = 2, 3, 3
LAYOUTS = ("flattened", "optimizer_key", "plain", "sharded")


def _sharded(state: dict, mesh) -> dict:
    """`state` with every tensor of one or more dimensions a DTensor sharded on dim 0."""
    try:  # public from torch 2.5
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import Shard, distribute_tensor
    if isinstance(state, dict):
        return {k: _sharded(v, mesh) for k, v in state.items()}
    if isinstance(state, torch.Tensor) and state.dim() > 0:
        return distribute_tensor(state, mesh, [Shard(0)])
    return state


def _mean(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _save_expected(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> None:
    from safetensors.torch import save_file

    values = {f"param/{n}": p for n, p in model.named_parameters()}
    values.update({f"buffer/{n}": b for n, b in model.named_buffers()})
    for n, p in model.named_parameters():
        values.update({f"state/{n}/{k}": v for k, v in opt.state[p].items() if k != "step"})
    save_file({k: v.detach().clone().contiguous() for k, v in values.items()}, path)


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    model = torch.nn.parallel.DistributedDataParallel(make_model(0))
    opt = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        loss = model(*batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss))
        if step == STEPS_BEFORE - 1:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{out}/optimizer_key")
            dcp.save(msd, checkpoint_id=f"{out}/plain")
            dcp.save(_sharded({"model": msd, "optimizer": osd}, mesh), checkpoint_id=f"{out}/sharded")
            msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/flattened")
            if rank == 0:
                _save_expected(model.module, opt, f"{out}/expected.safetensors")
    if rank == 0:
        expected = {"torch_version": torch.__version__, "world_size": WORLD, "layouts": list(LAYOUTS),
                    "losses_before": losses[:STEPS_BEFORE], "losses_after": losses[STEPS_BEFORE:]}
        Path(out, "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    dist.destroy_process_group()


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "tests" / "data" / "dcp")
    out = root / f"torch-{torch.__version__.split('+')[0]}"
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(out)), nprocs=WORLD)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
