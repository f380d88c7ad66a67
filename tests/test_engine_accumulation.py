"""set_gradient_accumulation_boundary: the caller says which backward ends a window (DeepSpeed's
override, Accelerate's protocol: step() once per window) instead of the engine counting
gradient_accumulation_steps step() calls. Both give the same weights, bit for bit."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks


def _train(rank, world_size, stage, override, ckpt):
    import zeroshard
    from zeroshard.errors import EngineUsageError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": stage}, "gradient_accumulation_steps": 3})
    g = torch.Generator().manual_seed(rank)
    pending = []
    for window in range(2):
        for micro in range(3):
            if override:
                engine.set_gradient_accumulation_boundary(micro == 2)
            engine.backward(engine(torch.randn(2, 4, generator=g)).pow(2).mean())
            pending.append(engine.pending_micro_batches)
            if not override or micro == 2:
                engine.step()
    refused = None
    if override:  # mid-window: the save refuses, whichever way the window is counted
        engine.set_gradient_accumulation_boundary(False)
        engine.backward(engine(torch.randn(2, 4, generator=g)).pow(2).mean())
        engine.step()
        try:
            engine.save_checkpoint(ckpt)
        except EngineUsageError as exc:
            refused = str(exc)
    return {"weights": engine.full_state_dict(), "steps": engine.global_steps, "refused": refused,
            "pending": pending}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_explicit_boundary_gives_the_counted_windows_weights(tmp_path, stage):
    counted = run_ranks(_train, 2, stage=stage, override=False, ckpt=str(tmp_path / "c"), timeout=120)[0]
    told = run_ranks(_train, 2, stage=stage, override=True, ckpt=str(tmp_path / "t"), timeout=120)[0]
    assert counted["steps"] == told["steps"] == 2  # the told run's last step() was not a boundary
    assert counted["weights"].keys() == told["weights"].keys()
    for name, tensor in counted["weights"].items():
        assert torch.equal(told["weights"][name], tensor), name
    assert counted["pending"] == [0, 1, 2, 0, 1, 2]  # counted: step() after each backward
    assert told["pending"] == [1, 2, 3, 1, 2, 3]  # told: step() only after the window's last backward
    assert told["refused"] and "micro-step 1 of 3" in told["refused"]
    assert not (tmp_path / "t").exists()
