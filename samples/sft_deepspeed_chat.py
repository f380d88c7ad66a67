"""Supervised fine-tuning written for DeepSpeed in the style of DeepSpeed-Chat's step 1
(applications/DeepSpeed-Chat/training/step1_supervised_finetuning/main.py and its dschat/utils):
a Hugging Face causal LM, `deepspeed.ops.adam.FusedAdam` (DeepSpeedCPUAdam with --offload) over
weight-decay groups, a transformers schedule handed to `deepspeed.initialize`, the config built
in code (hybrid_engine and tensorboard sections included), and at the end the model written as
DeepSpeed-Chat writes it: `save_hf_format` on rank 0, then at stage 3 `save_zero_three_model`,
which gathers each parameter with `deepspeed.zero.GatheredParameters`, choosing them by their
`ds_id` and `ds_status`. Synthetic tokens, a tiny Llama: runs offline on CPU in seconds.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 samples/sft_deepspeed_chat.py --zero-stage 3 \\
        --save-dir sft --out losses
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 samples/sft_deepspeed_chat.py --zero-stage 3 \\
        --load-dir sft --out losses-next     # the next step starts from the saved pytorch_model.bin

Nothing here names zeroshard: `samples/run_script.py --library zeroshard` runs it on
zeroshard.deepspeed with the `deepspeed` import pointed there.
"""

import argparse
import json
import math
import os

import deepspeed
import torch
from deepspeed import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="SFT in DeepSpeed-Chat's style (synthetic)")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=5e-3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_warmup_steps", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save-dir", default=None, help="DeepSpeed-Chat's --output_dir")
    parser.add_argument("--load-dir", default=None, help="start from a saved pytorch_model.bin")
    parser.add_argument("--out", default=None, help="folder for losses-rank<R>.json")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def get_train_ds_config(offload, stage, global_batch, micro_batch):
    """dschat/utils/ds_utils.py's get_train_ds_config, fp32."""
    device = "cpu" if offload else "none"
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                              "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "fp16": {"enabled": False, "loss_scale_window": 100},
        "bf16": {"enabled": False},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"},
    }


def get_optimizer_grouped_parameters(model, weight_decay,
                                     no_decay_name_list=("bias", "layer_norm.weight", "layernorm.weight",
                                                         "norm.weight", "ln_f.weight")):
    """dschat/utils/utils.py's grouping (no LoRA here): decay, then no decay."""
    groups = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n.lower() for nd in no_decay_name_list) and p.requires_grad],
         "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


class SyntheticPrompts(Dataset):
    """Token sequences with a pattern to learn, as input_ids / attention_mask / labels."""

    def __init__(self, n=32, seq=12, vocab=61, seed=7):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def build_model(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_hf_format(model, output_dir):
    """dschat/utils/utils.py's save_hf_format (no tokenizer here)."""
    model_to_save = model.module if hasattr(model, "module") else model
    os.makedirs(output_dir, exist_ok=True)
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, os.path.join(output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    """dschat/utils/utils.py's save_zero_three_model."""
    zero_stage_3 = zero_stage == 3
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


def get_all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def main(argv=None):
    args = parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    args.global_rank = torch.distributed.get_rank()
    device = torch.device(get_accelerator().device_name(max(args.local_rank, 0)))
    world = torch.distributed.get_world_size()
    ds_config = get_train_ds_config(args.offload, args.zero_stage, args.per_device_train_batch_size * world
                                    * args.gradient_accumulation_steps, args.per_device_train_batch_size)

    model = build_model(args.seed)
    if args.load_dir:  # step 2 and 3 start from step 1's pytorch_model.bin
        model.load_state_dict(torch.load(os.path.join(args.load_dir, "pytorch_model.bin"), weights_only=True))
    dataset = SyntheticPrompts(seed=7 if not args.load_dir else 8)
    loader = DataLoader(dataset, sampler=DistributedSampler(dataset, shuffle=False),
                        batch_size=args.per_device_train_batch_size)

    grouped = get_optimizer_grouped_parameters(model, args.weight_decay)
    AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = AdamOptimizer(grouped, lr=args.learning_rate, betas=(0.9, 0.95))
    steps = math.ceil(len(loader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name="cosine", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=steps)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)
    model.train()
    losses = []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch, use_cache=False)
        model.backward(outputs.loss)
        model.step()
        losses.append(get_all_reduce_mean(outputs.loss.detach().clone()).item())

    if args.save_dir:
        if args.global_rank == 0:
            save_hf_format(model, args.save_dir)
        if args.zero_stage == 3:  # at stage 3 the module's state dict is partitioned: gather it
            save_zero_three_model(model, args.global_rank, args.save_dir, zero_stage=args.zero_stage)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"losses-rank{args.global_rank}.json"), "w") as f:
            json.dump({"losses": losses}, f)
    return losses


if __name__ == "__main__":
    main()
