"""An LR scheduler built on the optimizer before initialize (PyTorch's usual order, and every
Accelerate or Trainer schedule) drives the engine: the engine steps the user's optimizer object
itself, re-pointed at its fp32 masters, as DeepSpeed steps the client optimizer. A rebuilt copy
left such a scheduler changing an optimizer nothing stepped: the LR stayed constant, silently."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

from distributed import run_ranks

TIER = "slow"  # docs/TESTING.md


def _stop_after_one_step(rank, world_size, stage):
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step == 0 else 0.0)  # then LR 0
    engine = zeroshard.initialize(model, opt, {"zero_optimization": {"stage": stage}})
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    weights = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            engine.backward(engine(x).pow(2).mean())
            engine.step()
            sched.step()
            weights.append(engine.full_state_dict())
    return {"same_object": engine.optimizer is opt, "lrs": [g["lr"] for g in engine.optimizer.param_groups],
            "moved": [any(not torch.equal(a[k], b[k]) for k in a) for a, b in zip(weights, weights[1:])],
            "warnings": [str(w.message) for w in seen if "lr_scheduler" in str(w.message)]}


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_scheduler_built_before_initialize_sets_the_engines_lr(stage):
    outs = run_ranks(_stop_after_one_step, 2, stage=stage, timeout=120)
    assert outs[0]["moved"] == [False, False]  # LR 0 from the second step: nothing moves (rank 0's weights)
    for out in outs:
        assert out["same_object"] and out["lrs"] == [0.0]
        assert out["warnings"] == []  # torch's "lr_scheduler.step() before optimizer.step()" sees the step


def _accelerate(rank, world_size, which, stage, gas, where, phase):
    """A training loop as Accelerate users write it: a torch optimizer and LambdaLR warmup handed
    to `accelerator.prepare` with a DeepSpeed plugin (Accelerate keeps the non-DeepSpeed scheduler
    and steps it itself); `save_state` half-way, `get_state_dict` at the end; phase "load" is a
    new run resuming from the saved state."""
    if which == "zeroshard":
        from samples.run_script import alias_deepspeed

        alias_deepspeed()  # `import deepspeed` (Accelerate's, inside prepare) gives zeroshard.deepspeed
    import deepspeed
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=gas)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    model, opt, loader, sched = accelerator.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4),
                                                    sched)
    batches = list(loader)

    def train(part):
        losses = []
        for x, y in part:
            with accelerator.accumulate(model):  # sets DeepSpeed's boundary; step() once per window
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses

    if phase == "load":
        accelerator.load_state(where)
        return {"resumed": train(batches[4:])}
    first = train(batches[:4])
    accelerator.save_state(where)
    rest = train(batches[4:])
    return {"losses": first + rest, "rest": rest, "weights": accelerator.get_state_dict(model)}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("accelerate") is None,
                    reason="needs DeepSpeed and Accelerate (installed by tools/dev.sh test --all, best effort)")
@pytest.mark.parametrize("stage,gas", [(2, 1), (1, 2), (3, 2)])
def test_accelerate_with_a_deepspeed_plugin_gives_deepspeeds_losses_and_resumes(tmp_path, stage, gas):
    """With accumulation Accelerate sets the boundary before each backward and calls the engine's
    step() once per window (set_gradient_accumulation_boundary, once refused here)."""
    def run(which, phase):
        env = {"DS_ACCELERATOR": "cpu"} if which == "deepspeed" else {}
        return run_ranks(_accelerate, 2, which=which, stage=stage, gas=gas, where=str(tmp_path / which),
                         phase=phase, init_process_group=False, env=env, fresh=True, timeout=240)

    ours, theirs = run("zeroshard", "save"), run("deepspeed", "save")
    # fp32, within 1e-5 relative (seen: 1e-7, the reductions' order): the warmup reaches the engine's
    # optimizer, where a constant LR differed by 1e-3 from the third step on
    assert len(ours[0]["losses"]) == 8
    for mine, real in zip(ours, theirs):
        assert mine["losses"] == pytest.approx(real["losses"], rel=1e-5)
    assert sorted(ours[0]["weights"]) == sorted(theirs[0]["weights"])
    for name, tensor in theirs[0]["weights"].items():  # get_state_dict: the same names and values
        assert torch.allclose(ours[0]["weights"][name], tensor, rtol=1e-5, atol=1e-7), name
    # save_state / load_state in a new run: the schedule, the optimizer and the weights come back
    resumed = run("zeroshard", "load")
    for before, after in zip(ours, resumed):
        assert after["resumed"] == before["rest"]
