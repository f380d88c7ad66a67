"""zeroshard.deepspeed's engine surface: getters, checkpoints with DeepSpeed's signatures,
zero.GatheredParameters, the optimizer section, accelerator and small pass-throughs."""

from __future__ import annotations

import argparse
import importlib.util
import math

import pytest
import torch

from distributed import run_ranks
from interop_model import batch, make_model

TIER = "slow"  # docs/TESTING.md

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
CONFIG = {"train_batch_size": 16, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}}}


def _train(engine, steps, rank):
    losses = []
    for step in steps:
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _checkpoint_roundtrip(rank, world_size, path, stage):
    import zeroshard.deepspeed as deepspeed

    cfg = {**CONFIG, "zero_optimization": {"stage": stage}}
    engine, optimizer, loader, sched = deepspeed.initialize(model=make_model(0), config=cfg)
    facts = {"micro": engine.train_micro_batch_size_per_gpu(), "gas": engine.gradient_accumulation_steps(),
             "tbs": engine.train_batch_size(), "stage": engine.zero_optimization_stage(),
             "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(), "rank": engine.global_rank,
             "local_rank": engine.local_rank, "same_opt": optimizer is engine.optimizer, "loader": loader,
             "sched": type(sched).__name__, "sched_attr": engine.lr_scheduler is sched,
             "module": engine.module is engine.engine.module,
             "native_gas_still_int": engine.engine.gradient_accumulation_steps == 2}
    _train(engine, range(6), rank)  # 3 optimizer steps
    facts["norm"] = engine.get_global_grad_norm()
    facts["saved"] = engine.save_checkpoint(path, client_state={"epoch": 4})
    facts["after"] = _train(engine, range(6, 10), rank)
    facts["lr_after"] = engine.get_lr()

    fresh, _, _, _ = deepspeed.initialize(model=make_model(1), config=cfg)
    load_path, client = fresh.load_checkpoint(path)
    facts["load"] = (load_path, client, fresh.global_steps, fresh.lr_scheduler.last_batch_iteration)
    facts["resumed"] = _train(fresh, range(6, 10), rank)
    facts["lr_resumed"] = fresh.get_lr()
    facts["missing"] = fresh.load_checkpoint(path + "-nothing-here")
    return facts


@pytest.mark.parametrize("stage", [1, 3])
def test_save_and_load_with_deepspeed_signatures(tmp_path, stage):
    facts = run_ranks(_checkpoint_roundtrip, 2, path=str(tmp_path / "ckpt"), stage=stage, init_process_group=False)
    for rank, f in enumerate(facts):
        assert (f["micro"], f["gas"], f["tbs"], f["stage"]) == (4, 2, 16, stage)
        assert (f["fp16"], f["bf16"], f["rank"], f["local_rank"]) == (False, False, rank, rank)
        assert f["same_opt"] and f["loader"] is None and f["sched"] == "WarmupLR" and f["sched_attr"] and f["module"]
        assert f["native_gas_still_int"]
        assert f["norm"] is not None and f["norm"] > 0  # clipping at DeepSpeed's default 1.0 computes it
        assert f["saved"] is True
        assert f["load"] == (str(tmp_path / "ckpt"), {"epoch": 4}, 3, 2)
        assert f["resumed"] == pytest.approx(f["after"], rel=1e-6)
        assert f["lr_resumed"] == f["lr_after"]
        assert f["missing"] == (None, None)
    assert (tmp_path / "ckpt" / "global_step3" / "zeroshard.json").exists()


def _gathered(rank, world_size, stage):
    import zeroshard.deepspeed as deepspeed

    model = make_model(0)
    reference = model.fc.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": stage}})
    with deepspeed.zero.GatheredParameters([model.fc.weight, model.fc.bias]):
        seen = model.fc.weight.detach().clone()
    with deepspeed.zero.GatheredParameters(model.fc.weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.fc.weight.fill_(0.25)
    full = engine.engine.full_state_dict()
    loss = engine(*batch(0, rank))  # training still works after the block
    engine.backward(loss)
    engine.step()
    storage = model.fc.weight.untyped_storage().size()
    return {"seen_ok": torch.equal(seen, reference), "full": full.get("fc.weight"), "storage": storage,
            "loss": loss.item()}


@pytest.mark.parametrize("stage", [2, 3])
def test_gathered_parameters_reads_and_writes_back(stage):
    out = run_ranks(_gathered, 2, stage=stage, init_process_group=False)
    assert all(o["seen_ok"] for o in out)
    assert torch.equal(out[0]["full"], torch.full((5, 5), 0.25))
    assert all(math.isfinite(o["loss"]) for o in out)
    if stage == 3:
        assert all(o["storage"] == 0 for o in out)  # released again after the block


def test_optimizer_section_has_deepspeed_meaning():
    from zeroshard.deepspeed.optimizers import build_optimizer

    p = [torch.nn.Parameter(torch.zeros(2))]
    adam = build_optimizer({"type": "Adam", "params": {"lr": 0.1}}, p)
    assert type(adam) is torch.optim.AdamW and adam.defaults["weight_decay"] == 0.0  # FusedAdam's default
    l2 = build_optimizer({"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, p)
    assert type(l2) is torch.optim.Adam and l2.defaults["lr"] == 1e-3
    assert type(build_optimizer({"type": "AdamW", "params": {"adam_w_mode": False}}, p)) is torch.optim.AdamW
    sgd = build_optimizer({"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}, p)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    for bad in ({"type": "Lamb"}, {"type": "OneBitAdam"}, {"type": "Adam", "params": {"max_grad_norm": 1.0}},
                {"type": "NoSuchThing"}):
        with pytest.raises(ValueError):
            build_optimizer(bad, p)


def test_batch_sizes_resolve_as_deepspeed():
    from zeroshard.deepspeed.config import batch_sizes, split_config

    assert batch_sizes({"train_batch_size": 32}, 2) == (32, 16, 1)
    assert batch_sizes({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2) == (32, 4, 4)
    assert batch_sizes({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4) == (24, 3, 2)
    assert batch_sizes({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, 2) == (32, 8, 2)
    with pytest.raises(ValueError, match="Either train_batch_size"):
        batch_sizes({}, 2)
    with pytest.raises(ValueError):
        batch_sizes({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, 2)
    split = split_config({"train_batch_size": 8, "optimizer": {"type": "SGD"}, "dataloader_drop_last": True}, 2)
    assert split.engine["gradient_clipping"] == 1.0 and "optimizer" not in split.engine and split.dataloader_drop_last
    assert split_config({"train_batch_size": 8, "gradient_clipping": 0.0}, 2).engine["gradient_clipping"] == 0.0


def test_config_arguments_accelerator_and_moe():
    import zeroshard.deepspeed as deepspeed
    from zeroshard.deepspeed.accelerator import Accelerator, get_accelerator
    from zeroshard.deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    acc = get_accelerator()
    assert acc.is_available() and acc.device_name(0) == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert acc.current_device_name() in ("cpu", f"cuda:{acc.current_device()}")
    cuda = Accelerator("cuda")
    assert (cuda.device_name(1) == "cuda:1" and cuda.device_name() == "cuda"
            and cuda.communication_backend_name() == "nccl")
    assert Accelerator("cpu").communication_backend_name() == "gloo"
    p = torch.nn.Parameter(torch.zeros(1))
    group = {"params": [p], "name": "parameters"}
    assert not is_moe_param(p) and split_params_into_different_moe_groups_for_optimizer(group) == [group]


def _initialize_errors(rank, world_size):
    import zeroshard.deepspeed as deepspeed

    errors = []
    # no optimizer anywhere at stage 1 (at stages 0 and 3: an inference engine, test_engine_inference.py)
    for kwargs in ({"config": {"train_batch_size": 4, "zero_optimization": {"stage": 1}}},
                   {"config": {**CONFIG}, "optimizer": torch.optim.SGD(make_model().parameters(), lr=0.1)},
                   {"config": CONFIG, "args": argparse.Namespace(deepspeed_config="x.json")},
                   {"config": CONFIG, "mpu": object()}):
        try:
            deepspeed.initialize(model=make_model(), **kwargs)
            errors.append(None)
        except (ValueError, NotImplementedError) as exc:
            errors.append(type(exc).__name__)
    return errors


def test_initialize_refuses_ambiguity():
    kinds = run_ranks(_initialize_errors, 1, init_process_group=False)[0]
    assert kinds == ["ConfigError", "ConfigError", "ConfigError", "UnsupportedFeatureError"]


def _load_deepspeed_folder(rank, world_size, path):
    import zeroshard.deepspeed as deepspeed
    from zeroshard.errors import CheckpointError

    with deepspeed.zero.Init():  # parameters on meta until initialize materializes them
        model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": 2}})
    try:
        engine.load_checkpoint(path)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_loading_a_deepspeed_folder_says_how_to_convert_it():
    from pathlib import Path

    path = str(Path(__file__).parent / "data" / "deepspeed" / "stage2")
    message = run_ranks(_load_deepspeed_folder, 2, path=path, init_process_group=False)[0]
    assert message and "zeroshard import deepspeed" in message and "\n" not in message


def _zero_init_defers(rank, world_size):
    import torch

    import zeroshard.deepspeed as deepspeed

    torch.manual_seed(0)
    with deepspeed.zero.Init():
        deferred = make_model(0)
    on_meta = all(p.is_meta for p in deferred.parameters())
    engine, *_ = deepspeed.initialize(model=deferred, config={**CONFIG, "zero_optimization": {"stage": 3}})
    torch.manual_seed(0)
    eager = make_model(0)
    state = engine.engine.full_state_dict()
    same = all(torch.equal(state[k].cpu(), v) for k, v in eager.state_dict().items()) if rank == 0 else True
    return on_meta, same


def test_zero_init_builds_on_meta_and_initialize_materializes_the_same_weights():
    for on_meta, same in run_ranks(_zero_init_defers, 2, init_process_group=False):
        assert on_meta and same


def _rng_after_load(rank, world_size, path):
    import random

    import numpy as np

    import zeroshard.deepspeed as deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(0), config={**CONFIG, "zero_optimization": {"stage": 2}})
    _train(engine, range(2), rank)
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    engine.save_checkpoint(path)
    saved_stream = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    draws = {}
    for opt_in in (False, True):
        torch.manual_seed(99), random.seed(99), np.random.seed(99)
        own_stream = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
        torch.manual_seed(99), random.seed(99), np.random.seed(99)
        engine.load_checkpoint(path, load_rng_states=True) if opt_in else engine.load_checkpoint(path)
        draws[opt_in] = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    return saved_stream, own_stream, draws


def test_load_checkpoint_leaves_rng_alone_unless_asked(tmp_path):
    """DeepSpeed's load_checkpoint never touches the RNG streams; load_rng_states=True restores the saved ones."""
    for saved_stream, own_stream, draws in run_ranks(_rng_after_load, 2, path=str(tmp_path / "c"),
                                                     init_process_group=False):
        assert saved_stream != own_stream
        assert draws[False] == own_stream  # untouched: the script's own seeding decides
        assert draws[True] == saved_stream


def _module_surface(rank, world_size, which, stage):
    """What a script can see of the engine as an nn.Module (the same code under either library)."""
    if which == "deepspeed":
        import deepspeed
    else:
        import zeroshard.deepspeed as deepspeed

    model = make_model(0)
    model.custom_attr = 7
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    # a client optimizer: DeepSpeed's config optimizer would JIT-compile FusedAdam on CPU
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    seen = []
    engine.register_forward_pre_hook(lambda mod, args: seen.append(("pre", type(mod).__name__, len(args))))
    handle = engine.register_forward_hook(lambda mod, args, out: seen.append(("post", type(mod).__name__,
                                                                              round(out.item(), 5))))
    loss = engine(*batch(0, rank))
    handle.remove()
    engine(*batch(0, rank))
    modes = []
    for flip in (engine.eval, engine.train):
        flip()
        modes.append((engine.training, model.training, all(m.training == model.training for m in model.modules())))
    sd = engine.state_dict()
    facts = {
        "is_module": isinstance(engine, torch.nn.Module), "module_is_model": engine.module is model,
        "named_parameters": [n for n, _ in engine.named_parameters()],
        "n_parameters": len(list(engine.parameters())),
        "named_buffers": [n for n, _ in engine.named_buffers()],
        "modules": [type(m).__name__ for m in engine.modules()],
        "children": [n for n, _ in engine.named_children()],
        "state_dict_keys": list(sd),
        "hooks": seen, "loss": round(loss.item(), 5), "modes": modes,
        "to_same_device": engine.to(engine.device) is engine, "custom_attr": engine.custom_attr,
        "getters": (engine.zero_optimization_partition_gradients(), engine.zero_optimization_partition_weights(),
                    engine.wall_clock_breakdown(), engine.optimizer_name(),
                    engine.steps_per_print(), engine.dataloader_drop_last()),
    }
    if stage < 3:  # whole parameters: the values and a load_state_dict round trip
        facts["state_dict_shapes"] = [tuple(v.shape) for v in sd.values()]
        changed = {k: v + 0.25 if k.endswith("fc.weight") else v for k, v in sd.items()}
        result = engine.load_state_dict(changed)
        facts["load_result"] = (list(result.missing_keys), list(result.unexpected_keys))
        facts["after_load"] = round(engine(*batch(0, rank)).item(), 5)
    return facts


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (optional: see docs/DEEPSPEED.md)")
@pytest.mark.parametrize("stage", [1, 3])
def test_engine_is_an_nn_module_like_deepspeeds(stage):
    ours = run_ranks(_module_surface, 1, which="zeroshard", stage=stage, init_process_group=False)[0]
    theirs = run_ranks(_module_surface, 1, which="deepspeed", stage=stage, init_process_group=False,
                       env={"DS_ACCELERATOR": "cpu"}, fresh=True)[0]
    assert ours == theirs
    assert ours["is_module"] and ours["named_parameters"][0].startswith("module.")
    assert ours["hooks"][:3] == [("pre", "DeepSpeedEngine", 2), ("post", "DeepSpeedEngine", ours["loss"]),
                             ("pre", "DeepSpeedEngine", 2)]


def _refusals(rank, world_size, stage):
    import zeroshard.deepspeed as deepspeed
    from zeroshard.errors import ZeroshardError

    engine, *_ = deepspeed.initialize(model=make_model(0), config={**CONFIG, "zero_optimization": {"stage": stage}})
    messages = []
    for attempt in (lambda: engine.to("meta"), lambda: engine.half(), lambda: engine.offload_states(),
                    lambda: engine.zero_reduce_bucket_size(),
                    lambda: engine.backward(torch.ones(()), retain_graph=True),
                    lambda: engine.compile()):
        try:
            attempt()
            messages.append(None)
        except ZeroshardError as exc:
            messages.append(str(exc))
    sd = engine.state_dict()
    empties = [k for k, v in sd.items() if v.numel() == 0]
    full = engine._zero3_consolidated_16bit_state_dict()  # Accelerate's way to the full weights
    expected = make_model(0).state_dict()
    same = list(full) == list(expected) and all(torch.equal(full[k], v) for k, v in expected.items())
    # load_state_dict writes the fp32 masters too (at any stage), not only the module's tensors
    engine.load_state_dict({f"module.{k}": v + 1 for k, v in expected.items()})
    after = engine._zero3_consolidated_16bit_state_dict()
    same = same and all(torch.equal(after[k], v + 1) for k, v in expected.items())
    return messages, hasattr(engine, "offload_states"), empties, engine.zero_optimization_partition_weights(), same


@pytest.mark.parametrize("stage", [1, 3])
def test_what_the_facade_refuses_is_one_line_naming_the_feature(stage):
    messages, has_offload, empties, partitioned, consolidated = run_ranks(_refusals, 1, stage=stage,
                                                                          init_process_group=False)[0]
    assert consolidated
    names = ["to(meta)", "half()", "offload_states", "zero_reduce_bucket_size", "backward(retain_graph=True",
             "compile"]
    for message, name in zip(messages, names):
        assert message and f"DeepSpeedEngine.{name}" in message and "\n" not in message, (name, message)
    assert not has_offload  # refused attributes are AttributeErrors: feature detection says no
    # stage 3: partitioned parameters show as empty tensors, as DeepSpeed's (which keeps only small ones whole)
    assert bool(empties) == (stage == 3) == partitioned


def _save_16bit(rank, world_size, which, stage, bf16, path):
    """save_16bit_model at the end of a short run, the same code under either library."""
    if which == "deepspeed":
        import deepspeed
    else:
        import zeroshard.deepspeed as deepspeed

    model = make_model(0)
    zero = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero, "bf16": {"enabled": bf16}}
    if bf16:
        model.bfloat16()  # DeepSpeed casts parameters, not buffers: the script does it (as the fixtures)
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(engine, range(2), rank)
    facts = {"returned": engine.save_16bit_model(path), "alias": engine.save_fp16_model(path, "old.pt")}
    if which == "zeroshard":
        facts["full"] = engine.engine.full_state_dict()  # the native engine's fp32 weights (rank 0)
    if stage == 3:
        no_gather = {**cfg, "zero_optimization": {"stage": 3}}
        second = make_model(0).bfloat16() if bf16 else make_model(0)
        other, *_ = deepspeed.initialize(model=second, config=no_gather,
                                         optimizer=torch.optim.AdamW(second.parameters(), lr=1e-2))
        facts["without_gather"] = other.save_16bit_model(path + "-not")
    return facts


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (optional: see docs/DEEPSPEED.md)")
@pytest.mark.parametrize("stage,bf16", [(1, False), (3, True)])
def test_save_16bit_model_writes_safetensors_with_deepspeeds_weights(tmp_path, stage, bf16):
    """DeepSpeed torch.saves pytorch_model.bin; the facade writes the same weights as
    model.safetensors (the name from_pretrained reads), streamed and atomic."""
    from safetensors.torch import load_file

    ours = run_ranks(_save_16bit, 2, which="zeroshard", stage=stage, bf16=bf16, path=str(tmp_path / "ours"),
                     init_process_group=False, timeout=180)
    theirs = run_ranks(_save_16bit, 2, which="deepspeed", stage=stage, bf16=bf16, path=str(tmp_path / "ds"),
                       init_process_group=False, env={"DS_ACCELERATOR": "cpu"}, fresh=True, timeout=180)
    assert [f["returned"] for f in ours] == [f["returned"] for f in theirs] == [True, True]
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["model.safetensors", "old.safetensors"]
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["old.pt", "pytorch_model.bin"]
    mine = load_file(tmp_path / "ours" / "model.safetensors")
    assert torch.equal(mine["emb.weight"], load_file(tmp_path / "ours" / "old.safetensors")["emb.weight"])
    deepspeeds = torch.load(tmp_path / "ds" / "pytorch_model.bin", weights_only=True)
    assert list(mine) == list(deepspeeds)  # the tied head too, under its own name
    compute = torch.bfloat16 if bf16 else torch.float32
    for name, tensor in deepspeeds.items():
        assert mine[name].dtype == tensor.dtype and mine[name].shape == tensor.shape, name
        if name in dict(make_model(0).named_parameters(remove_duplicate=False)):
            assert mine[name].dtype == compute
            assert torch.equal(mine[name], ours[0]["full"][name].to(compute)), name  # the engine's own, exactly
        assert torch.allclose(mine[name].float(), tensor.float(), rtol=1e-2 if bf16 else 1e-5, atol=1e-6), name
    if stage == 3:  # without stage3_gather_16bit_weights_on_model_save: nothing saved, as DeepSpeed
        assert [f["without_gather"] for f in ours] == [f["without_gather"] for f in theirs] == [False, False]
        assert not (tmp_path / "ours-not").exists()


def _save_16bit_into_a_file(rank, world_size, path):
    import zeroshard.deepspeed as deepspeed
    from zeroshard.errors import ZeroshardError

    model = make_model(0)
    cfg = {"train_micro_batch_size_per_gpu": 4,
           "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    try:
        engine.save_16bit_model(path)
    except ZeroshardError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_save_16bit_model_that_fails_on_rank_0_fails_on_every_rank(tmp_path):
    """Rank 0 cannot write (save_dir is a file): it goes on with the collective gathers, then
    every rank raises; none hangs, and the file in the way is untouched."""
    (tmp_path / "taken").write_text("a file")
    first, second = run_ranks(_save_16bit_into_a_file, 2, path=str(tmp_path / "taken"), init_process_group=False,
                              timeout=120)
    assert first is not None and "taken" in first[1], first
    assert second is not None and second[0] == "OtherRanksFailedError" and "save_16bit_model" in second[1], second
    assert (tmp_path / "taken").read_text() == "a file"


def _module_after_step(rank, world_size, stage):
    import zeroshard.deepspeed as deepspeed
    from zeroshard.deepspeed.ops.adam import FusedAdam
    from zeroshard.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    model = make_model(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=cfg,
                                                 optimizer=FusedAdam(model.parameters(), lr=1e-2, betas=(0.9, 0.95)))
    _train(engine, range(2), rank)
    full = engine.engine.full_state_dict()  # from the fp32 masters (rank 0)
    facts = {"optimizer": type(optimizer).__name__, "defaults": {k: optimizer.defaults[k] for k in ("betas", "eps")}}
    if stage < 3:  # read straight after step(), on rank 0 only, as scripts do
        state = engine.module.state_dict() if rank == 0 else {}
        facts["current"] = all(torch.equal(state[k], v) for k, v in full.items()) if rank == 0 else True
    else:
        weight = engine.module.fc.weight
        facts["tags"] = (weight.ds_id >= 0, weight.ds_numel == 25, tuple(weight.ds_shape) == (5, 5),
                         weight.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        with deepspeed.zero.GatheredParameters([weight]):
            inside = weight.ds_status == ZeroParamStatus.AVAILABLE
            kept = weight.data.cpu()  # the same tensor on the CPU: it must outlive the block
        facts["gathered"] = (inside, weight.ds_status == ZeroParamStatus.NOT_AVAILABLE,
                             rank != 0 or torch.equal(kept, full["fc.weight"]))
    return facts


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_module_is_current_after_step_and_stage_3_params_carry_deepspeeds_tags(stage):
    for facts in run_ranks(_module_after_step, 2, stage=stage, init_process_group=False):
        assert facts["optimizer"] == "AdamW" and facts["defaults"] == {"betas": (0.9, 0.95), "eps": 1e-8}
        if stage < 3:
            assert facts["current"]  # not the weights from before the last step
        else:
            assert facts["tags"] == (True, True, True, True) and facts["gathered"] == (True, True, True)


class _Regression(torch.nn.Module):
    """A float target passed beside the input: DeepSpeed casts neither (the script casts x)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        return ((self.lin(x).float() - target) ** 2).mean()


def _float_target(rank, world_size, which, fp16_auto_cast):
    if which == "deepspeed":
        import deepspeed
    else:
        import zeroshard.deepspeed as deepspeed

    half = torch.float16 if fp16_auto_cast else torch.bfloat16
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    cfg["fp16" if fp16_auto_cast else "bf16"] = {"enabled": True, **({"auto_cast": True} if fp16_auto_cast else {})}
    model = _Regression().to(half)
    engine, *_ = deepspeed.initialize(model=model, config=cfg,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    x, target = torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g) / 3  # not representable in 16 bits
    with torch.no_grad():
        if fp16_auto_cast:  # DeepSpeed's auto_cast casts the positional inputs, the target among them
            losses = [engine(x, target).item()]
        else:  # the script casts its input; the target stays fp32, as under DeepSpeed
            losses = [engine(x.to(half), target).item(), engine(x.to(half), target=target).item()]
    return {"losses": losses, "auto_cast": engine.fp16_auto_cast()}


def _cpu_does_fp16_for_deepspeed() -> bool:
    """What DeepSpeed 0.19's CPU accelerator asks before it takes an fp16 config (is_fp16_supported)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # as DeepSpeed: no answer is a no
        return False


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (optional: see docs/DEEPSPEED.md)")
@pytest.mark.parametrize("fp16_auto_cast", [False, True])
def test_forward_inputs_are_cast_only_as_deepspeed_casts_them(fp16_auto_cast):
    """The native engine casts floating inputs to the compute dtype (as FSDP2); DeepSpeed casts none
    unless fp16.auto_cast, and a float target rounded to bf16 would change every loss a little."""
    if fp16_auto_cast and not _cpu_does_fp16_for_deepspeed():
        pytest.skip("DeepSpeed's CPU accelerator refuses fp16 on a CPU without oneDNN fp16 (AVX512-FP16/AMX): "
                    "this machine's; the comparison runs where it has it")
    ours = run_ranks(_float_target, 2, which="zeroshard", fp16_auto_cast=fp16_auto_cast, timeout=120)
    theirs = run_ranks(_float_target, 2, which="deepspeed", fp16_auto_cast=fp16_auto_cast, init_process_group=False,
                       env={"DS_ACCELERATOR": "cpu"}, fresh=True, timeout=180)
    assert [o["losses"] for o in ours] == [t["losses"] for t in theirs]
    assert [o["auto_cast"] for o in ours] == [t["auto_cast"] for t in theirs] == [fp16_auto_cast] * 2


def _module_only_load(rank, world_size, which, path):
    """A warm start: load_checkpoint(load_module_only=True) into an engine that has trained a step."""
    if which == "deepspeed":
        import deepspeed
    else:
        import zeroshard.deepspeed as deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10}}}
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=torch.optim.AdamW(model.parameters()))
    _train(engine, range(6), rank)  # 3 optimizer steps
    engine.save_checkpoint(path, tag="pretrained")
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    model = make_model(1)
    fresh, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=torch.optim.AdamW(model.parameters()))
    _train(fresh, range(2), rank)  # 1 optimizer step
    fresh.load_checkpoint(path, tag="pretrained", load_module_only=True)
    same = all(torch.equal(v, saved[k]) for k, v in fresh.module.state_dict().items())
    facts = {"weights_loaded": same, "global_steps": fresh.global_steps, "skipped": fresh.skipped_steps,
             "lr": fresh.get_lr(), "scheduler_iteration": fresh.lr_scheduler.last_batch_iteration}
    facts["next"] = _train(fresh, range(2, 6), rank)
    facts["global_steps_after"] = fresh.global_steps
    return facts


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (optional: see docs/DEEPSPEED.md)")
def test_load_module_only_is_a_warm_start_as_in_deepspeed(tmp_path):
    """The weights come; the step count, the schedule and the optimizer state stay (it restored
    the counters, so a warm start went on from the pretrained run's step)."""
    ours = run_ranks(_module_only_load, 1, which="zeroshard", path=str(tmp_path / "ours"), init_process_group=False)[0]
    theirs = run_ranks(_module_only_load, 1, which="deepspeed", path=str(tmp_path / "theirs"),
                       init_process_group=False, env={"DS_ACCELERATOR": "cpu"}, fresh=True)[0]
    assert ours["weights_loaded"] and ours["global_steps"] == 1 and ours["global_steps_after"] == 3
    assert {k: v for k, v in ours.items() if k != "next"} == {k: v for k, v in theirs.items() if k != "next"}
    assert ours["next"] == pytest.approx(theirs["next"], rel=1e-5)
