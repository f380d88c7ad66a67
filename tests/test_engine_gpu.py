"""NCCL/CUDA path: skipped cleanly without CUDA (the CPU/gloo tests cover the logic).

World size = number of visible GPUs (at most 2); with one GPU this is a 1-rank NCCL job, which
still exercises device placement, NCCL collectives and CUDA memory accounting.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

TIER = "default"  # docs/TESTING.md

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def gpu_train(rank: int, world: int, stage: int, dtype: str) -> dict[str, Any]:
    import torch.distributed as dist

    import zeroshard

    from test_engine_models import batches, lm_loss, make_model, micro_batch

    model = make_model()
    cfg: dict[str, Any] = {"zero_optimization": {"stage": stage}, "gradient_clipping": 0.5}
    if dtype != "fp32":
        cfg[dtype] = {"enabled": True}
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                                  config=cfg)  # creates the NCCL group from the environment
    assert dist.get_backend() == "nccl" and engine.device.type == "cuda"
    losses = []
    for batch in batches(3, 16):
        x, y = (t.to(engine.device) for t in micro_batch(batch, rank, world, 0, 1))
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        t = loss.detach().float().reshape(1)
        dist.all_reduce(t)
        losses.append(t.item() / world)
    report = engine.memory_report()
    return {"losses": losses, "state": engine.full_state_dict(), "report": report}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nccl_matches_single_process(stage: int) -> None:
    from distributed import run_ranks
    from test_engine_models import assert_losses_close, assert_state_close, reference_run

    world = min(2, torch.cuda.device_count())
    ref = reference_run(3, 16, "adam", clip=0.5)
    result = run_ranks(gpu_train, world, timeout=300, init_process_group=False, stage=stage, dtype="fp32")[0]
    # TF32/cuBLAS differ from the CPU reference by more than summation order.
    assert_losses_close(result["losses"], ref["losses"], 1e-3)
    assert_state_close(result["state"], ref["state"], 1e-3)
    assert result["report"]["cuda_allocated"] > 0


def test_nccl_bf16_stage3_tracks_reference() -> None:
    from distributed import run_ranks
    from test_engine_models import assert_losses_close, reference_run

    world = min(2, torch.cuda.device_count())
    ref = reference_run(3, 16, "adam", clip=0.5)
    result = run_ranks(gpu_train, world, timeout=300, init_process_group=False, stage=3, dtype="bf16")[0]
    assert_losses_close(result["losses"], ref["losses"], 2e-2)
    assert result["report"]["params"] == 0


def gpu_offload(rank: int, world: int, stage: int, offload: bool) -> dict[str, Any]:
    import zeroshard

    from test_engine_models import batches, lm_loss, make_model, micro_batch

    model = make_model()
    z: dict[str, Any] = {"stage": stage}
    if offload:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                                  config={"zero_optimization": z, "gradient_clipping": 0.5})
    for batch in batches(3, 16):
        x, y = (t.to(engine.device) for t in micro_batch(batch, rank, world, 0, 1))
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    shards = [info for _, info in engine.named_shards()]
    states = [t for info in shards for t in info.tensor_state.values()]
    return {"state": engine.full_state_dict(),
            "masters": sorted({(i.master.device.type, i.master.is_pinned()) for i in shards}),
            "opt_state": sorted({t.device.type for t in states}),
            "params": sorted({p.device.type for p in engine.module.parameters()})}


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_optimizer_keeps_state_in_pinned_host_memory(stage: int) -> None:
    from distributed import run_ranks
    from test_engine_models import assert_state_close

    world = min(2, torch.cuda.device_count())
    plain = run_ranks(gpu_offload, world, timeout=300, init_process_group=False, stage=stage, offload=False)[0]
    off = run_ranks(gpu_offload, world, timeout=300, init_process_group=False, stage=stage, offload=True)[0]
    assert off["masters"] == [("cpu", True)] and off["opt_state"] == ["cpu"] and off["params"] == ["cuda"]
    assert plain["masters"] == [("cuda", False)]
    assert_state_close(off["state"], plain["state"], 1e-4)  # host vs device Adam: summation order only


def gpu_save_load(rank: int, world: int, stage: int, path: str, slow_writes: bool = False) -> dict[str, Any]:
    """Train, save, train on (every tensor changes), load: the state saved is the state loaded,
    on the device, read through checkpointing/staging.py's pinned windows.

    slow_writes: the writes behind the save are slow and the small-write threshold shrunk to
    1 KiB, so this tiny model's weights go out through windows still in flight when the next
    one is filled, with biases (gathered, not written) between them."""
    import zeroshard

    from test_engine_models import batches, lm_loss, make_model, micro_batch

    if slow_writes:
        import time

        from zeroshard.checkpointing import staging
        from zeroshard.storage import location, stream_writer

        write_now = location.AtomicWriter._write_now

        def slow(self, view):
            time.sleep(0.01)
            write_now(self, view)

        location.AtomicWriter._write_now = slow
        stream_writer.SMALL_WRITE_BYTES = staging.SMALL_WRITE_BYTES = 1024

    model = make_model()
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                                  config={"zero_optimization": {"stage": stage}})

    def step(batch) -> float:
        x, y = (t.to(engine.device) for t in micro_batch(batch, rank, world, 0, 1))
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    def snapshot() -> dict[str, torch.Tensor]:
        full = engine.full_state_dict()  # collective: every rank calls it, rank 0 gets it
        out = {f"param/{k}": v.cpu().clone() for k, v in full.items()}
        for _, info in engine.named_shards():
            out[f"master/{info.name}"] = info.master.cpu().clone()
            out.update({f"{key}/{info.name}": t.cpu().clone() for key, t in info.tensor_state.items()})
        return out

    def scalar_devices(of: Any = engine) -> set[str]:  # where Adam keeps `step`: host memory for a plain Adam
        return {str(v.device) for _, info in of.named_shards() for v in info.optimizer_state.values()
                if torch.is_tensor(v) and v.dim() == 0}

    data = list(batches(4, 16))
    for batch in data[:2]:
        step(batch)
    trained_scalars = scalar_devices()
    engine.save_checkpoint(path, tag="saved")
    saved = snapshot()
    next_loss = step(data[2])
    changed = snapshot()
    engine.load_checkpoint(f"{path}/saved")
    loaded = snapshot()
    devices = sorted({info.master.device.type for _, info in engine.named_shards()}
                     | {t.device.type for _, info in engine.named_shards() for t in info.tensor_state.values()})
    resumed_scalars = scalar_devices()
    other = make_model()
    fresh = zeroshard.initialize(model=other, optimizer=torch.optim.Adam(other.parameters(), lr=1e-2),
                                 config={"zero_optimization": {"stage": stage}})
    fresh.load_checkpoint(f"{path}/saved")  # a new process's engine: no optimizer state of its own yet
    return {"saved": saved, "changed": changed, "loaded": loaded, "devices": devices,
            "scalar_devices": (trained_scalars, resumed_scalars, scalar_devices(fresh)),
            "next_loss": next_loss, "next_loss_after_load": step(data[2])}


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_round_trip_on_the_device_is_bit_exact(stage: int, tmp_path) -> None:
    from distributed import run_ranks

    world = min(2, torch.cuda.device_count())
    out = run_ranks(gpu_save_load, world, timeout=300, init_process_group=False, stage=stage,
                    path=str(tmp_path / "ckpt"))
    for r in out:
        assert r["devices"] == ["cuda"]
        assert r["scalar_devices"] == ({"cpu"},) * 3  # `step` goes where Adam keeps it, in a fresh engine too
        assert sorted(r["loaded"]) == sorted(r["saved"])
        assert any(not torch.equal(r["changed"][k], r["saved"][k]) for k in r["saved"])  # the step changed them
        for key, value in r["saved"].items():
            assert torch.equal(r["loaded"][key], value), key
        assert abs(r["next_loss_after_load"] - r["next_loss"]) <= 1e-6 * abs(r["next_loss"])


def test_a_save_written_behind_through_the_pinned_windows_loads_bit_exact(tmp_path) -> None:
    """A sync save on the device writes behind: each window's write is still in flight while the
    next window is filled (on an H100 a reused window once changed under its write, and the
    checkpoint failed its own hash check on load)."""
    from distributed import run_ranks

    world = min(2, torch.cuda.device_count())
    out = run_ranks(gpu_save_load, world, timeout=300, init_process_group=False, stage=3,
                    path=str(tmp_path / "ckpt"), slow_writes=True)
    for r in out:
        for key, value in r["saved"].items():
            assert torch.equal(r["loaded"][key], value), key
