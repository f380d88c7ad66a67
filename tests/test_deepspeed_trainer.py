"""Hugging Face's Trainer with a DeepSpeed config, run on zeroshard.deepspeed (`import deepspeed`
pointed at it, as samples/run_script.py does) and on real DeepSpeed 0.19.8: the same losses, a
save every 3 steps (at stage 3 the Trainer saves the same tag twice: the second is a no-op,
repeat_save.py) and a resume from checkpoint-3 in a new run, which saves checkpoint-6 again over
the one there (overwritten, as DeepSpeed does, once the new one is committed). Needs transformers, Accelerate and
DeepSpeed (the test extras; skipped without them)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import zeroshard
from zeroshard.toolkit.verify import verify

from distributed import run_ranks

TIER = "slow"  # docs/TESTING.md

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("deepspeed", "accelerate", "transformers")),
    reason="needs DeepSpeed, Accelerate and transformers (installed by tools/dev.sh test --all, best effort)")


class _Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x}


def _trainer(rank, world_size, which, stage, out, resume):
    if which == "zeroshard":
        from samples.run_script import alias_deepspeed

        alias_deepspeed()
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    # use_cpu: Accelerate's CPU state (gloo, 2 processes); warmup, then a linear decay the resume must continue
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             learning_rate=1e-2, max_steps=6, save_steps=3, logging_steps=1, warmup_steps=2,
                             lr_scheduler_type="linear", deepspeed=ds, use_cpu=True, ddp_backend="gloo",
                             report_to="none", seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_Data())
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-3") if resume else None)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [2, 3])
def test_the_trainer_with_a_deepspeed_config_gives_deepspeeds_losses_and_resumes(tmp_path, stage):
    def run(which, resume=False):
        env = {"DS_ACCELERATOR": "cpu"} if which == "deepspeed" else {}
        return run_ranks(_trainer, 2, which=which, stage=stage, out=str(tmp_path / which), resume=resume,
                         init_process_group=False, env=env, fresh=True, timeout=240)[0]

    ours, theirs = run("zeroshard"), run("deepspeed")
    assert len(ours) == 6 and ours == pytest.approx(theirs, rel=1e-5)  # fp32 (seen: equal to 5 digits)
    saved = tmp_path / "zeroshard" / "checkpoint-3"
    assert (saved / "global_step3" / "zeroshard.json").exists() and (saved / "trainer_state.json").exists()
    # A rollback: resumed from checkpoint-3 while checkpoint-6 exists, the Trainer saves checkpoint-6 again.
    # DeepSpeed overwrites it; so do we, swapping the new one in only once it is committed.
    later = tmp_path / "zeroshard" / "checkpoint-6" / "global_step6"
    old_id = json.loads((later / "zeroshard.json").read_text())["id"]
    resumed = run("zeroshard", resume=True)
    assert resumed[3:] == pytest.approx(ours[3:], rel=1e-5)  # steps 4-6 again, schedule and Adam state restored
    assert json.loads((later / "zeroshard.json").read_text())["id"] != old_id
    assert sorted(os.listdir(later)) == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors",
                                         "zeroshard.json"] and verify(str(later)).ok
    weights_file = later.parent / "model.safetensors"  # the Trainer's own save of the same step, when it makes one
    if weights_file.exists():
        theirs_now, ours_now = load_file(str(weights_file)), zeroshard.load_state_dict(str(later))
        assert all(torch.equal(ours_now[k], v) for k, v in theirs_now.items() if k in ours_now)
