"""set_gradient_accumulation_boundary: the caller says which backward ends a window (DeepSpeed's
override, Accelerate's protocol: step() once per window) instead of the engine counting
gradient_accumulation_steps step() calls. Both give the same weights, bit for bit."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks

TIER = "default"  # docs/TESTING.md


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


def _save_with_windows_of_2(rank, world_size, ckpt):
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2})
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):  # 3 windows of 2: micro_steps 6
        engine.backward(engine(torch.randn(2, 4, generator=g)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(ckpt)
    return engine.full_state_dict()


def _resume_with_windows_of_4(rank, world_size, ckpt, batches):
    import zeroshard

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4})
    engine.load_checkpoint(ckpt)
    seen = [(engine.global_steps, engine.micro_steps, engine.pending_micro_batches)]
    for x in batches:
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        seen.append((engine.global_steps, engine.micro_steps, engine.pending_micro_batches))
    return {"seen": seen, "weights": engine.full_state_dict()}


def test_a_run_resumed_with_other_accumulation_steps_takes_whole_windows(tmp_path):
    """The usual resume at another world size: 2 ranks x 2 micro-batches saved after 3 steps
    (micro_steps 6), resumed by 1 rank x 4 micro-batches, the same global batch. The first step
    after the load takes all 4 micro-batches (it took 2 when the old run's count, 6 % 4, set the
    window), and the weights are plain SGD on their mean gradient."""
    saved = run_ranks(_save_with_windows_of_2, 2, ckpt=str(tmp_path / "ck"), timeout=120)[0]
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    resumed = run_ranks(_resume_with_windows_of_4, 1, ckpt=str(tmp_path / "ck"), batches=batches, timeout=120)[0]
    assert resumed["seen"] == [(3, 6, 0), (3, 7, 1), (3, 8, 2), (3, 9, 3), (4, 10, 0)]

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    model.load_state_dict(saved)
    for x in batches:
        (model(x).pow(2).mean() / 4).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(resumed["weights"][name], tensor, rtol=1e-6, atol=1e-7, msg=name)
