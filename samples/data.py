"""Training text, a character tokenizer, and world-size-independent batch sampling.

Corpus: CPython's own documentation topics (`pydoc_data.topics`, ~0.5 MB of English text),
joined in sorted-key order, so it ships with every Python and needs no download. Its exact
contents depend on the Python version; the vocabulary is therefore saved with the model
(a JSON list of characters) rather than recomputed at generation time.

Batches: the batch for optimizer step `s` is a pure function of (seed, s, global_batch,
block_size, data): `global_batch` random windows of the token stream. Each optimizer step is
split into `grad_accum` micro-batches, and each micro-batch into `world_size` equal rank
slices. Every (world_size, grad_accum) layout therefore covers exactly the same rows per step,
and the data-loader position is just the next step number, a tiny JSON dict
(`BatchSampler.state_dict()`), so a run may resume at a different world size and see the same
data stream.
"""

from __future__ import annotations

from typing import Sequence

import torch

SPLIT_FRACTION = 0.9  # first 90% of the token stream trains, the rest validates


def load_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class CharTokenizer:
    """One token per character; ids are positions in the sorted vocabulary list."""

    def __init__(self, vocab: Sequence[str]):
        self.vocab = list(vocab)
        if len(set(self.vocab)) != len(self.vocab):
            raise ValueError("vocabulary has duplicate characters")
        self.stoi = {ch: i for i, ch in enumerate(self.vocab)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.vocab[i] for i in ids)

    def to_json(self) -> list[str]:
        """JSON-able form (a list of one-character strings); `CharTokenizer(list)` reverses it."""
        return list(self.vocab)


def load_dataset() -> tuple[CharTokenizer, torch.Tensor, torch.Tensor]:
    """(tokenizer, train_ids, val_ids): the whole corpus encoded as int64 tensors."""
    text = load_corpus()
    tok = CharTokenizer.from_text(text)
    ids = torch.tensor(tok.encode(text), dtype=torch.long)
    n = int(SPLIT_FRACTION * len(ids))
    return tok, ids[:n], ids[n:]


def _generator(seed: int, step: int) -> torch.Generator:
    # Distinct, reproducible stream per (seed, step); independent of rank and world size.
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63 - 1))


def global_batch_starts(step: int, global_batch: int, block_size: int, n_tokens: int, seed: int = 0) -> torch.Tensor:
    """Start offsets (global_batch,) of the windows making optimizer step `step`'s batch."""
    if n_tokens <= block_size + 1:
        raise ValueError(f"data has {n_tokens} tokens, need more than block_size + 1 = {block_size + 1}")
    return torch.randint(n_tokens - block_size - 1, (global_batch,), generator=_generator(seed, step))


def rows_for(global_batch: int, world_size: int, rank: int, grad_accum: int = 1, micro: int = 0) -> slice:
    """Rows of the global batch that `rank` trains on in micro-batch `micro` of a step."""
    if global_batch % (world_size * grad_accum):
        raise ValueError(
            f"global batch {global_batch} is not divisible by world_size * grad_accum = "
            f"{world_size} * {grad_accum}"
        )
    if not (0 <= rank < world_size and 0 <= micro < grad_accum):
        raise ValueError(f"rank {rank}/{world_size} or micro-batch {micro}/{grad_accum} out of range")
    per_micro = global_batch // grad_accum
    per_rank = per_micro // world_size
    start = micro * per_micro + rank * per_rank
    return slice(start, start + per_rank)


def get_batch(
    data: torch.Tensor,
    step: int,
    global_batch: int,
    block_size: int,
    *,
    seed: int = 0,
    world_size: int = 1,
    rank: int = 0,
    grad_accum: int = 1,
    micro: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (x, y) for one micro-batch: x (rows, block_size) and y = x shifted by one."""
    starts = global_batch_starts(step, global_batch, block_size, len(data), seed)
    starts = starts[rows_for(global_batch, world_size, rank, grad_accum, micro)]
    offsets = torch.arange(block_size + 1)
    windows = data[starts[:, None] + offsets[None, :]]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class BatchSampler:
    """Iterates optimizer steps; its whole position is `{"step": ..., ...}` (JSON-able)."""

    def __init__(self, data: torch.Tensor, global_batch: int, block_size: int, *, seed: int = 0,
                 world_size: int = 1, rank: int = 0, grad_accum: int = 1, step: int = 0):
        rows_for(global_batch, world_size, rank, grad_accum)  # validates the layout
        self.data = data
        self.global_batch = global_batch
        self.block_size = block_size
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.grad_accum = grad_accum
        self.step = step  # the next optimizer step to draw

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The `grad_accum` micro-batches (this rank's slices) of the next optimizer step."""
        out = [
            get_batch(self.data, self.step, self.global_batch, self.block_size, seed=self.seed,
                      world_size=self.world_size, rank=self.rank, grad_accum=self.grad_accum, micro=m)
            for m in range(self.grad_accum)
        ]
        self.step += 1
        return out

    def state_dict(self) -> dict:
        # world_size / rank / grad_accum are deliberately absent: they do not change the stream.
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "block_size": self.block_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch", "block_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"data stream mismatch on resume: checkpoint has {key}={state[key]}, "
                    f"this run has {getattr(self, key)}"
                )
        self.step = int(state["step"])
