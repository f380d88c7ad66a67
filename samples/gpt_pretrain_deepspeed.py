"""A GPT pretraining loop written for DeepSpeed, in the style of DeepSpeedExamples'
training/ scripts (a causal transformer with dropout, the optimizer and WarmupDecayLR from the
DeepSpeed config, gradient accumulation, save_checkpoint with client_state and a resume through
load_checkpoint). Synthetic token data, a tiny model: runs offline on CPU in seconds.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 samples/gpt_pretrain_deepspeed.py --zero-stage 2 \\
        --save-dir ckpt --out losses
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 samples/gpt_pretrain_deepspeed.py --zero-stage 2 \\
        --load-dir ckpt --out losses-resumed

Nothing here names zeroshard: `python samples/on_zeroshard.py samples/gpt_pretrain_deepspeed.py ...`
runs it on zeroshard.deepspeed with the `deepspeed` import pointed there.
"""

import argparse
import json
import math
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="GPT pretraining (synthetic)")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps in all")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save-dir", default=None)
    parser.add_argument("--save-at", type=int, default=2, help="save after this many optimizer steps")
    parser.add_argument("--load-dir", default=None)
    parser.add_argument("--out", default=None, help="folder for losses-rank<R>.json")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab=61, dim=32, heads=4, layers=2, seq=16, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))


class SyntheticTokens(torch.utils.data.Dataset):
    """Deterministic token sequences with some structure to learn (no download)."""

    def __init__(self, n=64, seq=16, vocab=61, seed=7):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(seq + 1)) % vocab

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def ds_config(stage):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 100,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                          "warmup_num_steps": 2, "total_num_steps": 6,
                                                          "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
    }


def main(argv=None):
    args = get_args(argv)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    torch.manual_seed(args.seed)
    model = GPT()
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=SyntheticTokens(), config=ds_config(args.zero_stage))
    device = get_accelerator().device_name(engine.local_rank)
    start = 0
    if args.load_dir:
        _, client_state = engine.load_checkpoint(args.load_dir)
        start = client_state["step"]
    engine.train()
    gas = engine.gradient_accumulation_steps()
    losses, lrs = [], []
    batches = iter(loader)
    for _ in range(start * gas):  # the data the saved run already consumed
        next(batches)
    for step in range(start, args.steps):
        for _ in range(gas):
            idx, targets = (t.to(device) for t in next(batches))
            loss = engine(idx, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        lrs.append(engine.get_lr()[0])
        if args.save_dir and step + 1 == args.save_at:
            engine.save_checkpoint(args.save_dir, client_state={"step": step + 1})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"losses-rank{engine.global_rank}.json"), "w") as f:
            json.dump({"losses": losses, "lrs": lrs, "start": start}, f)
    return losses


if __name__ == "__main__":
    main()
