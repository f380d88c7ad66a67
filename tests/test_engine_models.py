"""Tiny models, data and the single-process reference that the engine tests compare against.

Imported by the other tests/test_engine_*.py files (and their spawned ranks); the few tests
here check the helpers themselves.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

TIER = "default"  # docs/TESTING.md

VOCAB, DIM, SEQ = 64, 32, 8


class Block(nn.Module):
    """Pre-norm transformer block; `gain` is a parameter held directly next to child modules."""

    def __init__(self, dim: int = DIM, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias gets exactly zero gradient
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.gain * self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """2 layers, dim 32, vocab 64, with the awkward cases the engine must handle:

    tied: head.weight is tok.weight; frozen: the position embedding; twice: `mix` runs twice
    per forward; `temp` has 3 elements (fewer than 4 ranks, so some ranks own none of it) and is
    held directly by the root module.
    """

    def __init__(self, tied: bool = True, frozen: bool = True, twice: bool = True, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.mix = nn.Linear(DIM, DIM) if twice else None
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.temp = nn.Parameter(torch.tensor([1.0, 0.5, 0.25]))
        self.use_mix = True  # tests switch it off on some steps: `mix` then gets no gradient
        if tied:
            self.head.weight = self.tok.weight
        if frozen:
            self.pos.weight.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        if self.mix is not None and self.use_mix:
            x = x + self.mix(torch.tanh(self.mix(x)))
        x = self.ln_f(x) * self.temp.sum()
        return self.head(x)


def make_model(seed: int = 0, freeze: tuple[str, ...] = (), **kwargs: Any) -> TinyGPT:
    """A TinyGPT with deterministic, non-trivial weights; `freeze` names more frozen parameters."""
    torch.manual_seed(seed)
    model = TinyGPT(**kwargs)
    for name, p in model.named_parameters():
        if name in freeze:
            p.requires_grad_(False)
    with torch.no_grad():  # make every parameter non-trivial (LayerNorm starts at 1/0)
        model.tok.weight.mul_(0.2)  # keep the (tied) logits in a realistic range
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def batches(steps: int, global_batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of (tokens, next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def micro_batch(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int, micro: int,
                gas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice for micro-step `micro` (the global batch split into world x gas parts)."""
    x, y = batch
    n = x.shape[0] // (world * gas)
    i = (micro * world + rank) * n
    return x[i: i + n], y[i: i + n]


def train_step(engine: Any, batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int, gas: int) -> float:
    """One optimizer step through the engine (gas micro-steps on this rank's slices); returns
    the global batch's mean loss (collective: every rank must call it)."""
    import torch.distributed as dist

    total = 0.0
    for m in range(gas):
        x, y = micro_batch(batch, rank, world, m, gas)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        total += loss.item()
    t = torch.tensor([total])
    dist.all_reduce(t)
    return t.item() / (world * gas)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "plain_sgd": lambda params: torch.optim.SGD(params, lr=0.1),
}


def grouped_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Two param groups with different hyperparameters (no decay for 1-d params)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2)


def build_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "grouped_adamw":
        return grouped_adamw(model)
    return OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad])


def reference_run(steps: int, global_batch: int, optimizer: str = "adam", clip: float = 0.0,
                  scheduler: bool = False, model_kwargs: dict | None = None,
                  skip_mix: tuple[int, ...] = ()) -> dict[str, Any]:
    """Single-process training on the whole global batch: per-step losses and final weights."""
    torch.manual_seed(0)
    model = make_model(**(model_kwargs or {}))
    opt = build_optimizer(optimizer, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    losses = []
    for step, (x, y) in enumerate(batches(steps, global_batch)):
        model.use_mix = step not in skip_mix
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (0 when both are 0)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff / denom if denom else diff


def assert_state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    errs = {k: rel_err(got[k], want[k]) for k in want}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= tol, f"{worst}: relative error {errs[worst]:.3g} > {tol} ({errs})"


def assert_losses_close(got: list[float], want: list[float], tol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert math.isfinite(g) and abs(g - w) <= tol * abs(w), f"step {i}: loss {g} vs {w} (tol {tol})"


# -- tests of the helpers themselves -------------------------------------------------------------


def test_micro_batches_tile_the_global_batch() -> None:
    batch = batches(1, 16)[0]
    parts = [micro_batch(batch, r, 2, m, 4)[0] for m in range(4) for r in range(2)]
    assert torch.equal(torch.cat(parts), batch[0])


def test_tiny_gpt_has_the_awkward_cases() -> None:
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names and model.head.weight is model.tok.weight
    assert not model.pos.weight.requires_grad
    assert model.temp.numel() == 3
    assert lm_loss(model(batches(1, 2)[0][0]), batches(1, 2)[0][1]).isfinite()
