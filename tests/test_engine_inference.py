"""Engines built without an optimizer, for inference: the reference and reward models of RLHF
(TRL's prepare_deepspeed, DeepSpeed-Chat's step 3), evaluation-only runs.

Natively `zeroshard.initialize(model, None, config)`; under zeroshard.deepspeed an `initialize`
with no optimizer and no optimizer section (or TRL's `{"type": None}`). Forward only, at stage 0
or 3; the partitions hold the compute dtype. Every test runs 2 gloo CPU ranks.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from distributed import run_ranks
from interop_model import batch, make_model, make_optimizer

TIER = "mixed"  # docs/TESTING.md

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _inference(rank, world_size, stage, bf16):
    import zeroshard
    from zeroshard.errors import EngineUsageError

    model, plain = make_model(0), make_model(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    if bf16:  # the model arrives in bf16, buffer included (as from_pretrained(torch_dtype=...) gives it)
        cfg["bf16"] = {"enabled": True}
        model, plain = model.bfloat16(), plain.bfloat16()
    engine = zeroshard.initialize(model, None, cfg)
    with torch.no_grad():
        got = [engine(*batch(step, rank)) for step in range(2)]
        want = [plain(*batch(step, rank)) for step in range(2)]
    refused = []
    for attempt in (lambda: engine.backward(got[0]), lambda: engine.step(),
                    lambda: engine.save_checkpoint("/nonexistent/never-written")):
        try:
            attempt()
            refused.append(None)
        except EngineUsageError as exc:
            refused.append(str(exc))
    loss = engine(*batch(0, rank))  # grad mode: a graph through the parameters
    try:
        loss.backward()  # the usual slip: a reference output left in the loss without no_grad
        refused.append(None)
    except EngineUsageError as exc:
        refused.append(str(exc))
    with torch.no_grad():
        again = torch.equal(engine(*batch(0, rank)), want[0])
    released = [p.untyped_storage().size() for p in model.parameters()]
    full = engine.full_state_dict()
    same_weights = rank != 0 or all(torch.equal(full[k], v.float()) for k, v in plain.state_dict().items()
                                    if k != "scale")
    shards = engine.shards
    return {"equal": all(torch.equal(a, b) for a, b in zip(got, want)) and again, "refused": refused,
            "released": released, "grads": [p.grad for p in model.parameters()],
            "optimizer": engine.optimizer, "memory": engine.memory_report(), "weights": same_weights,
            "partition_bytes": sum(s.chunk for s in shards) * (2 if bf16 else 4),
            "whole_bytes": sum(s.numel for s in shards) * (2 if bf16 else 4),
            "master_dtypes": {s.master.dtype for s in shards}}


@pytest.mark.parametrize("stage,bf16", [(0, False), (3, False), (3, True)])
def test_an_engine_without_an_optimizer_runs_forward_as_the_plain_model(stage, bf16):
    for out in run_ranks(_inference, 2, stage=stage, bf16=bf16, timeout=120):
        assert out["equal"] and out["weights"] and out["optimizer"] is None
        backward, step, save, slip = out["refused"]
        assert slip and "torch.no_grad()" in slip  # not the whole model's gradients kept on every rank
        assert out["grads"] == [None] * 5
        assert (out["released"] == [0] * 5) == (stage == 3)
        assert backward and "engine.backward()" in backward and "without an optimizer" in backward
        assert step and "engine.step()" in step
        assert save and "save_checkpoint" in save and "full_state_items" in save
        memory = out["memory"]
        assert memory["grads"] == memory["optimizer"] == memory["optimizer_state"] == 0
        # stage 3: each rank holds its partition (2 bytes an element in bf16: no fp32 copy); stage 0 the model
        assert memory["params"] == (out["partition_bytes"] if stage == 3 else out["whole_bytes"])
        assert out["master_dtypes"] == {torch.bfloat16 if bf16 else torch.float32}


def _stage_without_optimizer(rank, world_size, stage):
    import zeroshard

    try:
        zeroshard.initialize(make_model(0), None, {"train_micro_batch_size_per_gpu": 4,
                                                   "zero_optimization": {"stage": stage}})
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_without_an_optimizer_are_refused_as_deepspeed_refuses_them(stage):
    for message in run_ranks(_stage_without_optimizer, 2, stage=stage):
        assert message and f"stage {stage}" in message and "use stage 3" in message and "\n" not in message


def _reference_of_a_trained_actor(rank, world_size, ckpt, weights):
    """DeepSpeed-Chat's step 3 in miniature: the actor trains and saves; the reference model, an
    inference engine at another stage and dtype, takes the actor's weights from the checkpoint
    (the optimizer state is left) or from a full-model file."""
    import zeroshard

    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    actor_model = make_model(0)
    actor = zeroshard.initialize(actor_model, make_optimizer(actor_model.parameters()), cfg)
    for step in range(3):
        actor.backward(actor(*batch(step, rank)))
        actor.step()
    actor.save_checkpoint(ckpt)
    full = actor.full_state_dict()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v for k, v in full.items() if k != "head.weight"}, weights)  # tied: saved once
    torch.distributed.barrier()
    with torch.no_grad():
        want = actor(*batch(9, rank))
    out = {}
    for source in ("checkpoint", "pretrained"):
        ref = zeroshard.initialize(make_model(1), None, {"train_micro_batch_size_per_gpu": 4,
                                                          "zero_optimization": {"stage": 3}})
        if source == "checkpoint":
            ref.load_checkpoint(ckpt)
        else:
            ref.load_pretrained(weights)
        with torch.no_grad():
            out[source] = torch.equal(ref(*batch(9, rank)), want)
        out[source + "_steps"] = ref.global_steps
    return out


def test_a_reference_model_loads_the_actors_checkpoint_or_weights(tmp_path):
    for out in run_ranks(_reference_of_a_trained_actor, 2, ckpt=str(tmp_path / "actor"),
                         weights=str(tmp_path / "actor.safetensors"), timeout=180):
        assert out["checkpoint"] and out["pretrained"]
        assert out["checkpoint_steps"] == 3  # the counters come with the weights; the optimizer state is left


def _prepare_deepspeed(model, ds_config, deepspeed):
    """TRL's prepare_deepspeed (trl/models/utils.py), as its trainers build reference models."""
    config_kwargs = copy.deepcopy(ds_config)
    hidden_size = 5
    if config_kwargs["zero_optimization"]["stage"] == 3:
        config_kwargs.update({"zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
                              "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
                              "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden_size * hidden_size})
    if config_kwargs["zero_optimization"]["stage"] != 3:
        config_kwargs["zero_optimization"]["stage"] = 0
    config_kwargs["optimizer"] = {"type": None}
    model, *rest = deepspeed.initialize(model=model, config=config_kwargs)
    model.eval()
    return model, rest


def _trl_reference(rank, world_size, which, stage, bf16):
    if which == "deepspeed":
        import deepspeed
    else:
        import zeroshard.deepspeed as deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    model = make_model(0).bfloat16() if bf16 else make_model(0)
    engine, (optimizer, _, scheduler) = _prepare_deepspeed(model, cfg, deepspeed)
    with torch.no_grad():
        losses = [engine(*batch(step, rank)).float().item() for step in range(3)]
    # (DeepSpeed's own get_lr() fails at stage 3 here: its optimizer stand-in has no param groups)
    return {"losses": losses, "training": engine.module.training,
            "lr": engine.get_lr() if which == "zeroshard" or stage != 3 else None,
            "stage": engine.zero_optimization_stage(), "returned_none": (optimizer is None, scheduler is None)}


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (optional: see docs/DEEPSPEED.md)")
@pytest.mark.parametrize("stage,bf16", [(2, False), (3, False), (3, True)])
def test_trls_reference_model_gives_deepspeeds_outputs(stage, bf16):
    ours = run_ranks(_trl_reference, 2, which="zeroshard", stage=stage, bf16=bf16, timeout=120)
    theirs = run_ranks(_trl_reference, 2, which="deepspeed", stage=stage, bf16=bf16, init_process_group=False,
                       env={"DS_ACCELERATOR": "cpu"}, fresh=True, timeout=180)
    for mine, real in zip(ours, theirs):
        assert mine["losses"] == real["losses"]  # exactly: the same weights, the same ops
        assert mine["training"] is real["training"] is False
        assert mine["stage"] == real["stage"] == (3 if stage == 3 else 0)
        assert mine["returned_none"] == (True, True)
        assert mine["lr"] == [] and real["lr"] in ([], None)  # None: not asked at stage 3
