"""A save repeated into the same tag with nothing changed returns the committed checkpoint
(the HF Trainer saves DeepSpeed's checkpoint twice at stage 3); anything changed since, and the
committed tag is still never overwritten (checkpointing/repeat_save.py)."""

from __future__ import annotations

import os
import shutil

import torch

from distributed import run_ranks

TIER = "default"  # docs/TESTING.md


def _saves(rank, world_size, root):
    import zeroshard
    from zeroshard.errors import CheckpointSaveError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": 3}})

    def train():
        engine.backward(engine(torch.randn(3, 4)).pow(2).mean())
        engine.step()

    def save(**kw):
        try:
            return engine.save_checkpoint(root, tag="t", **kw)
        except CheckpointSaveError:
            return "refused"

    train()
    first = save(client_state={"epoch": 1})
    manifest = os.path.join(first, "zeroshard.json")
    stamp = os.stat(manifest).st_mtime_ns
    out = {"again": save(client_state={"epoch": 1}) == first and os.stat(manifest).st_mtime_ns == stamp,
           "other_client_state": save(client_state={"epoch": 2})}
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(first)  # removed behind the Checkpointer's back: a repeat must write it again
    torch.distributed.barrier()
    out["rewritten"] = save(client_state={"epoch": 1}) == first and os.path.exists(manifest)
    with torch.no_grad():
        engine(torch.randn(3, 4, generator=torch.Generator().manual_seed(5)))  # train mode: BatchNorm's statistics move
    out["buffers_moved"] = save(client_state={"epoch": 1})
    torch.rand(1)  # the RNG stream moved: the checkpoint's RNG state is no longer this one
    out["rng_moved"] = save(client_state={"epoch": 1})
    engine.eval()
    with torch.no_grad():
        engine(torch.randn(3, 4))  # eval: no buffer change either, but the RNG moved again
    torch.manual_seed(0)
    train()
    out["after_a_step"] = save(client_state={"epoch": 1})
    return out


def test_a_repeated_save_is_a_no_op_and_any_change_is_refused(tmp_path):
    for out in run_ranks(_saves, 2, root=str(tmp_path / "ck"), timeout=120):
        assert out["again"] and out["rewritten"]
        assert out["other_client_state"] == out["buffers_moved"] == out["rng_moved"] == "refused"
        assert out["after_a_step"] == "refused"
