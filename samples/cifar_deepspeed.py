"""A DeepSpeed training script, run by zeroshard: only the two import lines below differ from
DeepSpeed (modelled on DeepSpeedExamples' training/cifar/cifar10_deepspeed.py, with synthetic
CIFAR-shaped data so nothing is downloaded).

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 samples/cifar_deepspeed.py --deepspeed --stage 2

With real DeepSpeed installed, `import deepspeed` / `from deepspeed.accelerator import
get_accelerator` run the same file (tests/test_deepspeed_compat.py does exactly that and
compares the losses). --out DIR writes each rank's per-step losses and LRs as JSON.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard.deepspeed as deepspeed  # was: import deepspeed
from zeroshard.deepspeed.accelerator import get_accelerator  # was: from deepspeed.accelerator import get_accelerator


def get_args():
    parser = argparse.ArgumentParser(description="CIFAR (synthetic)")
    parser.add_argument("-e", "--epochs", default=1, type=int)
    parser.add_argument("--samples", default=64, type=int, help="synthetic training images")
    parser.add_argument("--seed", default=1138, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stage", default=0, type=int, help="ZeRO stage")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--micro-batch", default=4, type=int)
    parser.add_argument("--grad-accum", default=1, type=int)
    parser.add_argument("--scheduler", default="WarmupLR")
    parser.add_argument("--out", default=None, help="folder for losses-rank<R>.json")
    parser.add_argument("--ckpt", default=None, help="save a checkpoint here at the end")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def synthetic_cifar(n, seed):
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 3, 32, 32, generator=g) * 2 - 1
    labels = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def scheduler_section(name):
    params = {"WarmupLR": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 5},
              "WarmupDecayLR": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 3,
                                "total_num_steps": 8, "warmup_type": "linear"},
              "WarmupCosineLR": {"total_num_steps": 8, "warmup_num_steps": 3, "warmup_min_ratio": 0.1},
              "OneCycle": {"cycle_min_lr": 0.0001, "cycle_max_lr": 0.002, "cycle_first_step_size": 3,
                           "cycle_momentum": True, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}}[name]
    return {"type": name, "params": params}


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    torch.manual_seed(args.seed)
    net = Net()
    trainset = synthetic_cifar(args.samples, args.seed)
    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7, "torch_adam": True}},
        "scheduler": scheduler_section(args.scheduler),
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.dtype == "bf16"},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000},
    }
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)

    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else None
    criterion = nn.CrossEntropyLoss()
    losses, lrs = [], []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            lrs.append(model_engine.get_lr()[0])
            if model_engine.global_rank == 0 and i % 4 == 3:
                print(f"[{epoch + 1}, {i + 1:3d}] loss: {loss.item():.4f} lr: {lrs[-1]:.6f} "
                      f"grad norm: {model_engine.get_global_grad_norm()}")
    if args.ckpt:
        model_engine.save_checkpoint(args.ckpt, client_state={"epoch": args.epochs})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"losses-rank{model_engine.global_rank}.json"), "w") as f:
            json.dump({"losses": losses, "lrs": lrs, "train_batch_size": model_engine.train_batch_size(),
                       "gradient_accumulation_steps": model_engine.gradient_accumulation_steps(),
                       "stage": model_engine.zero_optimization_stage()}, f)
    print("Finished Training")


if __name__ == "__main__":
    main()
