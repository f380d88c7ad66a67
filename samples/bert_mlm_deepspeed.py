"""BERT masked-language-model pretraining written for DeepSpeed, in the style of
DeepSpeedExamples' training/HelloDeepSpeed/train_bert.py: the script builds its own data loader
(DistributedSampler), passes the DeepSpeed config as a dict, uses `Adam` (AdamW mode) and
WarmupLR from it, saves with `save_checkpoint(save_dir=..., client_state=...)` and resumes with
`load_checkpoint(load_dir=...)`. Synthetic tokens and a tiny encoder: offline, CPU, seconds.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 samples/bert_mlm_deepspeed.py --zero-stage 1 \\
        --save-dir ckpt --out losses

Nothing here names zeroshard: `samples/run_script.py --library zeroshard` runs it on
zeroshard.deepspeed with the `deepspeed` import pointed there.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PAD, MASK, VOCAB, SEQ = 0, 1, 53, 12


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="BERT MLM (synthetic)")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--zero-stage", type=int, default=1)
    parser.add_argument("--num-iterations", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--save-dir", default=None)
    parser.add_argument("--load-dir", default=None)
    parser.add_argument("--out", default=None, help="folder for losses-rank<R>.json")
    return parser.parse_args(argv)


class MaskedTokens(Dataset):
    """Token rows with 15% of positions masked; the masking is fixed per row (no global RNG)."""

    def __init__(self, n=80, seed=3):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(2, VOCAB, (n, 1), generator=g)
        self.tokens = (base + torch.arange(SEQ) * torch.randint(1, 4, (n, 1), generator=g)) % (VOCAB - 2) + 2
        self.masked = torch.rand(n, SEQ, generator=g) < 0.15
        self.masked[:, 0] = True  # at least one target per row

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        inputs = self.tokens[i].masked_fill(self.masked[i], MASK)
        labels = self.tokens[i].masked_fill(~self.masked[i], -100)
        return inputs, labels


class SelfAttention(nn.Module):
    """HF BERT/RoBERTa-style attention (query/key/value/output Linear modules), as the
    RobertaForMaskedLM HelloDeepSpeed trains."""

    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dense = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, h, pad):
        b, t, c = h.shape
        q, k, v = (f(h).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for f in (self.query, self.key, self.value))
        scores = (q @ k.transpose(-1, -2)) / (c // self.heads) ** 0.5
        probs = self.drop(scores.masked_fill(pad[:, None, None, :], float("-inf")).softmax(-1))
        ctx = (probs @ v).transpose(1, 2).reshape(b, t, c)
        return self.norm(h + self.drop(self.dense(ctx)))


class Layer(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.attention = SelfAttention(dim, heads, dropout)
        self.intermediate = nn.Linear(dim, 2 * dim)
        self.output = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, h, pad):
        h = self.attention(h, pad)
        return self.norm(h + self.drop(self.output(F.gelu(self.intermediate(h)))))


class BertMLM(nn.Module):
    def __init__(self, dim=32, heads=4, layers=2, dropout=0.1):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, dim, padding_idx=PAD)
        self.positions = nn.Embedding(SEQ, dim)
        self.norm = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(Layer(dim, heads, dropout) for _ in range(layers))
        self.transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.decoder = nn.Linear(dim, VOCAB)

    def forward(self, inputs, labels):
        pos = torch.arange(inputs.size(1), device=inputs.device)
        h = self.drop(self.norm(self.embeddings(inputs) + self.positions(pos)))
        for layer in self.layers:
            h = layer(h, inputs == PAD)
        logits = self.decoder(self.transform(h))
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)


def main(argv=None):
    args = get_args(argv)
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else None)
    torch.manual_seed(args.seed)
    model = BertMLM()
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3,
                                                     "warmup_num_steps": 3, "warmup_type": "linear"}},
        "zero_optimization": {"stage": args.zero_stage},
    }
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    dataset = MaskedTokens()
    sampler = DistributedSampler(dataset, num_replicas=model.world_size, rank=model.global_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=model.train_micro_batch_size_per_gpu(), sampler=sampler)
    start = 0
    if args.load_dir:
        _, client_state = model.load_checkpoint(load_dir=args.load_dir)
        start = client_state["checkpoint_step"]
    model.train()
    losses = []
    batches = iter(loader)
    for step in range(1, args.num_iterations + 1):
        inputs, labels = next(batches)
        if step <= start:  # seen before the checkpoint
            continue
        loss = model(inputs.to(model.device), labels.to(model.device))
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if args.save_dir and step % args.checkpoint_every == 0:
            model.save_checkpoint(save_dir=args.save_dir, client_state={"checkpoint_step": step})
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"losses-rank{model.global_rank}.json"), "w") as f:
            json.dump({"losses": losses, "lr": model.get_lr()[0], "start": start}, f)
    return losses


if __name__ == "__main__":
    main()
