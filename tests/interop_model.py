"""The tiny model and data of the DeepSpeed/DCP interop fixtures (tests/data/deepspeed).

Shared by tools/make_deepspeed_fixtures.py (which trains it with real DeepSpeed) and the
tests (which resume it with zeroshard). Data is arithmetic, not random, so it is the same on
every machine and torch version. Odd parameter sizes make every partition padded; the output
head is tied to the embedding; a buffer rides along.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, MICRO_BATCH = 13, 5, 6, 4
LR, BETAS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 0.01


class TinyTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((DIM,), 0.5))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + torch.tanh(self.fc(self.norm(h))) * self.scale
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


def make_model(seed: int = 0, frozen: tuple[str, ...] = ()) -> TinyTied:
    """The model; parameters named in `frozen` get requires_grad False, as fine-tuning leaves them."""
    torch.manual_seed(seed)
    model = TinyTied()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    return model


# the fp16 fixture's dynamic loss scaling: 2**16 overflows fp16 (max 65504) before a gradient is
# computed, 2**15 does not here. With a window of 3 good steps DeepSpeed grows the scale at the first
# step after the save and the next two steps overflow (one skipped by hysteresis, one halving the
# scale): a resume that restarts the scaler, or miscounts its good steps, applies steps DeepSpeed skipped
FP16 = {"enabled": True, "initial_scale_power": 15, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 1}
FROZEN = ("fc.weight", "fc.bias")  # frozen in the fixtures of frozen parameters: random, so a drop shows


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


def two_groups(model: torch.nn.Module) -> list[dict]:
    """Param groups as Hugging Face's Trainer makes them: weight decay on the matrices only (the
    embedding and fc.weight), none on LayerNorm and biases."""
    decay = [p for n, p in model.named_parameters() if n in ("emb.weight", "fc.weight")]
    rest = [p for n, p in model.named_parameters() if n not in ("emb.weight", "fc.weight")]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


def warmup(step: int) -> float:
    """The LR factor of the scheduler fixtures' torch LambdaLR (transformers' warmup schedules are
    LambdaLRs too): still rising when the fixtures save, so a schedule restarted from 0 shows."""
    return min(1.0, (step + 1) / 16)


class TrainerTied(TinyTied):
    """TinyTied as Hugging Face's Trainer calls a model (keyword inputs, a dict with the loss
    out), keeping every loss it computed: the same parameters, so a checkpoint of either loads
    into the other."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = super().forward(input_ids, labels)
        self.losses.append(loss.item())
        return {"loss": loss}


def trainer_llama(seed: int) -> nn.Module:
    """A two-layer Llama of transformers' own code (its config.json names the class), for the
    Trainer fixture without DeepSpeed: q/o, k/v and gate/up projections share shapes, so only
    the parameter order tells their optimizer states apart."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=8, intermediate_size=12, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16,
                                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return transformers.LlamaForCausalLM(config)


def trainer_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch of every step and rank in the HF Trainer fixture: its dataset is one sample
    repeated, so what the Trainer's sampler hands each rank is known without running it."""
    tokens, targets = batch(0, 0)
    return tokens[:1].repeat(MICRO_BATCH, 1), targets[:1].repeat(MICRO_BATCH, 1)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `step` of data-parallel rank `rank`."""
    i = torch.arange(MICRO_BATCH * SEQ)
    tokens = ((i * 7 + step * 5 + rank * 3) % VOCAB).reshape(MICRO_BATCH, SEQ)
    targets = (tokens * 3 + 1 + (i.reshape(MICRO_BATCH, SEQ) % 2)) % VOCAB
    return tokens, targets


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The loss averaged over the ranks of the default process group."""
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def zeroshard_resumed_losses(rank: int, world_size: int, path: str, stage: int = 3, clip: float = 0.0,
                             frozen: tuple[str, ...] = ()) -> list[float]:
    """A rank of run_ranks: zeroshard resumes an imported checkpoint and trains steps 3-5 (the
    steps the fixtures' own tools trained after saving at step 2); the mean losses."""
    import zeroshard

    engine = zeroshard.initialize(model=make_model(1, frozen), optimizer=make_optimizer,
                                  config={"zero_optimization": {"stage": stage}, "gradient_clipping": clip,
                                          "train_micro_batch_size_per_gpu": MICRO_BATCH})
    engine.load_checkpoint(path)
    losses = []
    for step in (3, 4, 5):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(mean_over_ranks(loss))
    return losses
