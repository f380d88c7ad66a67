"""Generate the small real DeepSpeed checkpoints under tests/data/deepspeed.

Needs DeepSpeed (CPU build is enough; the `offload` variant JIT-builds DeepSpeed's CPU Adam op
with the local g++ on first use, a few minutes):
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu .venv/bin/pip install -c tools/constraints.txt --no-build-isolation deepspeed
    DS_ACCELERATOR=cpu .venv/bin/python tools/make_deepspeed_fixtures.py [OUT_DIR [VARIANT ...]]

For each variant (VARIANTS below), 2 gloo ranks train tests/interop_model.py's TinyTied with
DeepSpeed for STEPS_BEFORE steps, save (tag global_step3), train STEPS_AFTER more; then a
fresh DeepSpeed engine (different initial weights) loads the checkpoint and trains the same
STEPS_AFTER steps: DeepSpeed's own resume. expected.json records all three loss sequences
(mean over ranks), so tests can check that zeroshard resumed from an import continues as
DeepSpeed does, without DeepSpeed installed.

Variants: stage1/2/3 (a client torch AdamW); offload (stage 2, `offload_optimizer: cpu` and a
config AdamW, so DeepSpeedCPUAdam with its int `step`); offload_stage3 (stage 3 offloading
both the optimizer and the parameters to the CPU); bf16 (stage 1, bf16 with fp32 gradient
accumulation: DeepSpeed's BF16_Optimizer, `bf16_zero_pp_rank_*` files); bf16_stage2 and bf16_stage3 (the ZeRO
optimizer in bf16, also `bf16_` files); hf (stage 2 saved the way Hugging Face's Trainer does,
into `checkpoint-3/` with `trainer_state.json` beside `global_step3/`); universal (stage 2
converted by DeepSpeed's own ds_to_universal, resumed by DeepSpeed with `load_universal`);
frozen_stage1/2/3 (FROZEN parameters have requires_grad False, as in fine-tuning: DeepSpeed
keeps them out of its optimizer and saves them in the model-states files only);
frozen_universal_stage3 (frozen_stage3 through ds_to_universal, which keeps them only in the
per-rank model-states files it copies); accelerate (stage 2 driven by Accelerate's
`Accelerator(deepspeed_plugin=...)`, saved with `save_state` and resumed with `load_state`);
accelerate_lambdalr (the same with a torch LambdaLR warmup prepared beside the model, as
transformers' schedules are: DeepSpeed takes only its own schedule classes, so Accelerate keeps
this one and saves it as `scheduler.bin` beside the tag folder); hf_trainer (Hugging Face's
Trainer itself, `TrainingArguments(deepspeed=...)` with ZeRO 2 on CPU, its default AdamW (two
param groups: no weight decay on biases and LayerNorm) and linear warmup schedule, saving
`checkpoint-3/` and resuming with `train(resume_from_checkpoint=...)`; its dataset repeats one
sample, so each rank's batches are known); hf_trainer_lora (the same Trainer on the model
wrapped by PEFT's LoRA on `fc`: the Trainer saves a PEFT model with DeepSpeed's
`exclude_frozen_parameters=True`, so only the adapters, and tied copies, are in DeepSpeed's files;
both runs build the base from seed 0, as from one pretrained checkpoint, the resume's adapters
from seed 1); hf_trainer_lora_stage3 (the same at ZeRO 3); fp16 (stage 2, fp16 with DeepSpeed's
dynamic loss scaling set by interop_model.FP16 so that it grows and overflows around the save);
stage3_subgroups (stage 3 with `sub_group_size` 20 and two param groups, interop_model.two_groups:
DeepSpeed cuts the first group's partition into two flat groups, so param_shapes lists three);
universal_stage3_subgroups (that through ds_to_universal); elastic_stage2 (stage 2 with
`elastic_checkpoint`, which zeroshard refuses: saved only, DeepSpeed cannot resume it either);
hf_trainer_ddp (the Trainer with no DeepSpeed, DDP over gloo, on interop_model.trainer_llama);
config_file (stage 2 configured the way DeepSpeed's launcher examples are, `args.deepspeed_config`
naming a JSON file: releases that keep the path save it, not the config, as `ds_config`).
"""

from __future__ import annotations

import argparse
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
from interop_model import (  # noqa: E402
    BETAS,
    FP16,
    FROZEN,
    LR,
    MICRO_BATCH,
    WEIGHT_DECAY,
    batch,
    make_model,
    make_optimizer,
    trainer_batch,
    two_groups,
    warmup,
)

WORLD, STEPS_BEFORE, STEPS_AFTER = 2, 3, 3
TAG = f"global_step{STEPS_BEFORE}"
HF_FOLDER = f"checkpoint-{STEPS_BEFORE}"
UNIVERSAL_FOLDER = f"{TAG}_universal"
VARIANTS = {
    "stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3},
    "offload": {"stage": 2, "offload": True},
    "offload_stage3": {"stage": 3, "offload": True, "offload_param": True},
    "bf16": {"stage": 1, "bf16": True},
    "bf16_stage2": {"stage": 2, "bf16": True},
    "bf16_stage3": {"stage": 3, "bf16": True},
    "fp16": {"stage": 2, "fp16": True},
    "stage3_subgroups": {"stage": 3, "sub_group_size": 20, "groups": True},
    "universal_stage3_subgroups": {"stage": 3, "sub_group_size": 20, "groups": True, "universal": True},
    "hf": {"stage": 2, "hf": True},
    "universal": {"stage": 2, "universal": True},
    "universal_stage3": {"stage": 3, "universal": True},
    "frozen_stage1": {"stage": 1, "frozen": True},
    "frozen_stage2": {"stage": 2, "frozen": True},
    "frozen_stage3": {"stage": 3, "frozen": True},
    "frozen_universal_stage3": {"stage": 3, "frozen": True, "universal": True},
    "accelerate": {"stage": 2, "accelerate": True},
    "accelerate_lambdalr": {"stage": 2, "accelerate": True, "scheduler": True},
    "hf_trainer": {"stage": 2, "trainer": True},
    "hf_trainer_lora": {"stage": 2, "trainer": True, "lora": True},
    "hf_trainer_lora_stage3": {"stage": 3, "trainer": True, "lora": True},
    # a layout zeroshard refuses: DeepSpeed 0.19.8 cannot resume it either with a torch optimizer
    # (its load asserts on base_optimizer_state_step, which only optimizers keeping `step` in
    # their param groups save), so the fixture is the save alone
    "elastic_stage2": {"stage": 2, "elastic": True, "refused": True},
    # the Trainer with no DeepSpeed (DDP over gloo): stage 0 means the engine resumes it as DDP
    "hf_trainer_ddp": {"stage": 0, "trainer": True, "ddp": True},
    # DeepSpeed's own launcher recipe: `--deepspeed_config ds_config.json` parsed into args. Up to
    # 0.18.0 at least, the engine keeps that path and saves it as the checkpoint's ds_config (0.18.9
    # and later load the file first and save the dict)
    "config_file": {"stage": 2, "config_file": True},
}
LORA = {"target_modules": ["fc"], "r": 2, "lora_alpha": 4, "init_lora_weights": False}  # random B: the adapters act
# the HF Trainer fixture's schedule (transformers' get_scheduler arguments)
TRAINER_SCHEDULE = {"name": "linear", "num_warmup_steps": 4, "num_training_steps": STEPS_BEFORE + STEPS_AFTER}


def ds_config(variant: dict, resume: bool = False) -> dict:
    zero: dict = {"stage": variant["stage"]}
    if variant.get("elastic"):  # base_optimizer_state: one lean state per param group
        zero["elastic_checkpoint"] = True
    if variant.get("sub_group_size"):  # stage 3 cuts a param group's partition into flat groups this big
        zero["sub_group_size"] = variant["sub_group_size"]
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if variant.get("offload"):  # DeepSpeed then builds DeepSpeedCPUAdam from the config's optimizer
        zero["offload_optimizer"] = {"device": "cpu"}
        if variant.get("offload_param"):
            zero["offload_param"] = {"device": "cpu"}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": 1e-8,
                                                           "weight_decay": WEIGHT_DECAY}}
    if variant.get("bf16"):
        config["bf16"] = {"enabled": True}
        if variant["stage"] == 1:  # bf16 params + fp32 accumulation at stage 1 selects BF16_Optimizer
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    if variant.get("fp16"):  # dynamic loss scaling that overflows, skips and grows within a few steps
        config["fp16"] = FP16
    if variant.get("universal") and resume:
        config["checkpoint"] = {"load_universal": True}
    return config


def save_dir(out: str, variant: dict) -> str:
    return os.path.join(out, HF_FOLDER) if variant.get("hf") else out


def _engine(variant: dict, seed: int, resume: bool = False):
    import deepspeed

    # the frozen variants freeze part of the model, as fine-tuning does; the optimizer gets them all
    model = make_model(seed, FROZEN if variant.get("frozen") else ())
    if variant.get("accelerate"):  # Accelerate builds the DeepSpeed engine from its plugin's config
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        config = {**ds_config(variant, resume), "train_batch_size": MICRO_BATCH * WORLD}
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
        optimizer = make_optimizer(model.parameters())
        if not variant.get("scheduler"):
            engine, _ = accelerator.prepare(model, optimizer)
        else:  # an AcceleratedScheduler: steps the LambdaLR once per process at each optimizer step
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
            engine, _, engine.client_scheduler = accelerator.prepare(model, optimizer, scheduler)
        engine.accelerator = accelerator  # save_state / load_state
        return engine
    if variant.get("bf16"):  # DeepSpeed casts parameters, not buffers: the fp32 `scale` would promote h
        model.bfloat16()
    if variant.get("fp16"):
        model.half()
    if variant.get("offload"):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(variant, resume))
    elif variant.get("config_file"):
        import argparse
        import tempfile

        path = Path(tempfile.mkdtemp(), "ds_config.json")
        path.write_text(json.dumps(ds_config(variant, resume)))
        args = argparse.Namespace(deepspeed_config=str(path), local_rank=int(os.environ["LOCAL_RANK"]))
        engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=make_optimizer(model.parameters()))
    else:
        params = two_groups(model) if variant.get("groups") else model.parameters()
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(params),
                                          config=ds_config(variant, resume))
    return engine


def _train(engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        tokens, targets = batch(step, dist.get_rank())
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        if getattr(engine, "client_scheduler", None) is not None:
            engine.client_scheduler.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _trainer(rank: int, name: str, phase: str, out: str) -> None:
    """Hugging Face's Trainer drives DeepSpeed (or, `ddp`, DDP alone): train to step 6 saving
    checkpoint-3, or resume it."""
    import deepspeed
    from transformers import Trainer, TrainingArguments

    from interop_model import TrainerTied, trainer_llama

    lora, ddp = VARIANTS[name].get("lora"), VARIANTS[name].get("ddp")
    torch.manual_seed(0 if phase == "save" or lora else 1)  # fresh weights the resume must overwrite...
    model = inner = trainer_llama(0 if phase == "save" else 1) if ddp else TrainerTied()
    if ddp:  # the mean loss of each forward, as the model computes it outside the Trainer (no token count)
        inner.losses = []
        inner.register_forward_hook(lambda m, args, kwargs, out: m.losses.append(
            m.loss_function(out.logits, kwargs["labels"], vocab_size=m.config.vocab_size).item()), with_kwargs=True)
    if lora:  # ... but a LoRA run's base is its pretrained model, the same in both; its adapters are fresh
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0 if phase == "save" else 1)
        model = get_peft_model(model, LoraConfig(**LORA))
    tokens, targets = trainer_batch()
    data = [{"input_ids": tokens[0], "labels": targets[0]}] * 64
    config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "zero_optimization": {"stage": VARIANTS[name]["stage"]}, "zero_allow_untested_optimizer": True}
    # use_cpu: Accelerate's CPU state (gloo, 2 processes); DeepSpeed still runs the optimizer
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO_BATCH, max_steps=6, save_steps=3,
                             logging_steps=1, learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                             weight_decay=WEIGHT_DECAY, warmup_steps=TRAINER_SCHEDULE["num_warmup_steps"],
                             lr_scheduler_type=TRAINER_SCHEDULE["name"], deepspeed=None if ddp else config,
                             report_to="none", seed=0, use_cpu=True, ddp_backend="gloo", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=os.path.join(out, HF_FOLDER) if phase == "resume" else None)
    losses = torch.tensor(inner.losses)
    dist.all_reduce(losses)
    losses = (losses / WORLD).tolist()
    progress = Path(out, "progress.json")
    if rank == 0 and phase == "save":
        scheduler = torch.load(os.path.join(out, HF_FOLDER, "scheduler.pt"), weights_only=True)
        progress.write_text(json.dumps({"losses_before": losses[:STEPS_BEFORE], "losses_after": losses[STEPS_BEFORE:],
                                        "scheduler_last_epoch": scheduler["last_epoch"]}))
    if rank == 0 and phase == "resume":
        import transformers

        expected = {"variant": name, "stage": VARIANTS[name]["stage"], "world_size": WORLD, "tag": TAG,
                    "deepspeed_version": deepspeed.__version__, "transformers_version": transformers.__version__,
                    "torch_version": torch.__version__, **json.loads(progress.read_text()), "losses_resumed": losses,
                    "client_state": {}, "scheduler": TRAINER_SCHEDULE, **({"lora": LORA} if lora else {})}
        expected["scheduler_steps_per_step"] = expected.pop("scheduler_last_epoch") // STEPS_BEFORE
        Path(out, "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def _rank(rank: int, port: int, name: str, phase: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
                       "LOCAL_WORLD_SIZE": str(WORLD)})
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    variant = VARIANTS[name]
    if variant.get("trainer"):
        _trainer(rank, name, phase, out)
        dist.barrier()
        dist.destroy_process_group()
        return
    progress = Path(out, "progress.json")
    if phase == "save":
        engine = _engine(variant, 0)
        before = _train(engine, range(STEPS_BEFORE))
        client = None if variant.get("hf") else {"epoch": 1, "note": "fixture"}  # the Trainer passes none
        if variant.get("accelerate"):  # the tag is Accelerate's ("pytorch_model"), beside its own files
            engine.accelerator.save_state(out)
        else:
            engine.save_checkpoint(save_dir(out, variant), tag=TAG, client_state=client or {})
        scheduler = getattr(engine, "client_scheduler", None)
        saved = {"scheduler_last_epoch": scheduler.scheduler.last_epoch} if scheduler is not None else {}
        after = _train(engine, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        if rank == 0:
            progress.write_text(json.dumps({"losses_before": before, "losses_after": after, **saved}))
    else:
        fresh = _engine(variant, 1, resume=True)  # different weights: the load must overwrite every one
        if variant.get("accelerate"):
            fresh.accelerator.load_state(out)
            client = None
        else:
            _, client = fresh.load_checkpoint(save_dir(out, variant))
        resumed = _train(fresh, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        if rank == 0:
            expected = {"variant": name, "stage": variant["stage"], "world_size": WORLD, "tag": TAG,
                        "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
                        **json.loads(progress.read_text()), "losses_resumed": resumed,
                        "client_state": {k: client[k] for k in ("epoch", "note") if k in (client or {})}}
            if variant.get("fp16"):  # what the resume's loss scaling did: steps skipped, the scale at the end
                expected.update(skipped_steps=fresh.skipped_steps, loss_scale=fresh.optimizer.loss_scaler.cur_scale)
            if variant.get("scheduler"):  # how the resume must step the LambdaLR to follow Accelerate's
                expected["scheduler_steps_per_step"] = expected.pop("scheduler_last_epoch") // STEPS_BEFORE
            Path(out, "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_trainer_state(path: Path, losses: list[float]) -> None:
    """checkpoint-N/trainer_state.json as Hugging Face's Trainer writes it: with transformers'
    own TrainerState.save_to_json where transformers is installed, else the same fields by hand."""
    history = [{"epoch": round((i + 1) / 6, 4), "grad_norm": 1.0, "learning_rate": LR, "loss": round(loss, 4),
                "step": i + 1} for i, loss in enumerate(losses)]
    try:
        from transformers import TrainerControl, TrainerState
    except ImportError:
        path.write_text(json.dumps(trainer_state(history), indent=2, sort_keys=True) + "\n")
        return
    TrainerState(epoch=round(STEPS_BEFORE / 6, 4), global_step=STEPS_BEFORE, max_steps=6, logging_steps=1,
                 save_steps=STEPS_BEFORE, train_batch_size=MICRO_BATCH, num_train_epochs=1, log_history=history,
                 stateful_callbacks=[TrainerControl(should_save=True)]).save_to_json(str(path))


def trainer_state(history: list[dict]) -> dict:
    """transformers 5.x's TrainerState fields, for machines without transformers."""
    return {"best_global_step": None, "best_metric": None, "best_model_checkpoint": None,
            "epoch": round(STEPS_BEFORE / 6, 4), "eval_steps": 500, "global_step": STEPS_BEFORE,
            "is_hyper_param_search": False, "is_local_process_zero": True, "is_world_process_zero": True,
            "log_history": history, "logging_steps": 1, "max_steps": 6, "num_input_tokens_seen": 0,
            "num_train_epochs": 1, "save_steps": STEPS_BEFORE,
            "stateful_callbacks": {"TrainerControl": {"args": {"should_epoch_stop": False, "should_evaluate": False,
                                                               "should_log": False, "should_save": True,
                                                               "should_training_stop": False},
                                                      "attributes": {}}},
            "total_flos": 0, "train_batch_size": MICRO_BATCH, "trial_name": None, "trial_params": None}


def to_universal(out: Path) -> None:
    """DeepSpeed's own converter (deepspeed.checkpoint.ds_to_universal), as its CLI runs it."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(out / TAG), output_folder=str(out / UNIVERSAL_FOLDER),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)
    ds_to_universal.main(args)  # writes out/latest_universal naming UNIVERSAL_FOLDER


def make(root: Path, name: str) -> None:
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    mp.spawn(_rank, args=(_free_port(), name, "save", str(out)), nprocs=WORLD)
    if VARIANTS[name].get("hf"):
        progress = json.loads((out / "progress.json").read_text())
        write_trainer_state(out / HF_FOLDER / "trainer_state.json", progress["losses_before"])
    if VARIANTS[name].get("universal"):
        to_universal(out)
    if VARIANTS[name].get("refused"):
        (out / "expected.json").write_text(json.dumps({"variant": name, "stage": VARIANTS[name]["stage"],
                                                       "world_size": WORLD, "tag": TAG, "refused": True}) + "\n")
    else:
        mp.spawn(_rank, args=(_free_port(), name, "resume", str(out)), nprocs=WORLD)
    (out / "progress.json").unlink()
    if VARIANTS[name].get("universal"):  # keep only what ds_to_universal wrote
        shutil.rmtree(out / TAG)
        (out / "latest").unlink()
    if VARIANTS[name].get("trainer"):  # the Trainer's own checkpoint-3/ is the fixture; its last save is not
        shutil.rmtree(out / f"checkpoint-{STEPS_BEFORE + STEPS_AFTER}")
    for folder in (out, out / HF_FOLDER):  # DeepSpeed copies its own scripts beside saves
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (folder / script).unlink(missing_ok=True)
    print(out, json.loads((out / "expected.json").read_text()))


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "tests" / "data" / "deepspeed")
    for name in sys.argv[2:] or list(VARIANTS):
        try:
            make(root, name)
        except mp.ProcessExitedException as exc:
            # seen rarely on a loaded 2-core machine: a rank aborts in native teardown ("terminate
            # called without an active exception") after its work is done; a Python error is not retried
            print(f"{name}: a rank died ({exc}); making it again", file=sys.stderr)
            make(root, name)


if __name__ == "__main__":
    main()
