"""Where each parameter's elements live: one ParamShard per unique parameter.

Every parameter follows zeroshard.partition exactly: flattened, cut into `world` chunks of
`chunk_size(numel, world)` elements, this rank owning `shard_range(numel, world, rank)`. The fp32
master of that range is a `chunk`-element tensor: the real elements first, zero padding after,
so every rank's chunk has the same size and collectives need no uneven variants.

Collective buffers put rank r's chunks in row r: a bucket of params with chunks c1, c2, ... is a
[world, c1 + c2 + ...] tensor; param i occupies columns [offset_i, offset_i + c_i) of every row.
`rows_to_flat` moves a whole (unpadded) tensor out of such a column block; `column_pairs` pairs a
bucket's tensors with their blocks, for one `_foreach_copy_` either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Container, Iterator

import torch
from torch import nn

from zeroshard.errors import InvalidArgumentError
from zeroshard.partition import chunk_size, shard_range


@dataclass(eq=False)
class ParamShard:
    """One unique parameter and this rank's share of it."""

    index: int  # position in deduplicated `named_parameters()` order
    name: str  # first name under which the module registers it (tied params: the first)
    param: nn.Parameter  # the module's parameter object (compute dtype; stage 3: gathered on demand)
    shape: torch.Size
    dtype: torch.dtype  # the parameter's dtype before the engine took over
    start: int  # owned flat range [start, end) per zeroshard.partition
    end: int
    chunk: int  # padded chunk size (same on every rank)
    requires_grad: bool
    # fp32 (an inference engine's: the compute dtype), `chunk` elements: real ones first, zero padding after
    master: torch.Tensor

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def owned(self) -> int:
        return self.end - self.start

    @property
    def fragment(self) -> torch.Tensor:
        """The real (unpadded) elements of the master: flat[start:end] of the full tensor."""
        return self.master[: self.owned]


@dataclass(frozen=True)
class ShardInfo:
    """What `ZeroEngine.named_shards()` yields: everything a checkpoint needs for one parameter.

    `master` and `optimizer_state` are live references (not copies). Optimizer state values that
    are tensors with `dim() >= 1` are per-element (same shape as `master`, `chunk` elements, real
    ones first); 0-dim tensors and Python numbers (e.g. Adam's `step`) are scalar state.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int
    chunk: int
    world_size: int  # the partition's world size (1 at stage 0: every rank holds everything)
    requires_grad: bool
    master: torch.Tensor
    optimizer_state: dict[str, Any]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def fragment(self) -> torch.Tensor:
        return self.master[: self.end - self.start]

    @property
    def tensor_state(self) -> dict[str, torch.Tensor]:
        """Per-element optimizer state (each `chunk` elements, real ones first)."""
        return {k: v for k, v in self.optimizer_state.items() if torch.is_tensor(v) and v.dim() >= 1}

    @property
    def scalar_state(self) -> dict[str, Any]:
        """Scalar optimizer state (0-dim tensors, numbers)."""
        return {k: v for k, v in self.optimizer_state.items() if not (torch.is_tensor(v) and v.dim() >= 1)}


def unique_named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """named_parameters() with tied parameters once, under their first name."""
    yield from module.named_parameters(remove_duplicate=True)


def build_shards(module: nn.Module, world: int, rank: int, device: torch.device,
                 pending: Container[int] = (), pin: bool = False,
                 dtype: torch.dtype = torch.float32) -> list[ParamShard]:
    """A ParamShard per unique parameter, with masters (fp32; an inference engine's in its
    compute dtype) copied from the current values (zeros for the params in `pending`, whose
    values come later: see meta_init.py)."""
    shards = []
    for index, (name, p) in enumerate(unique_named_parameters(module)):
        numel = p.numel()
        start, end = shard_range(numel, world, rank)
        chunk = chunk_size(numel, world)
        master = (torch.zeros(chunk, dtype=dtype, device=device) if not pin
                  else torch.zeros(chunk, dtype=dtype, pin_memory=True))  # offload.py
        if id(p) not in pending:
            master[: end - start].copy_(p.detach().reshape(-1)[start:end])
        shards.append(ParamShard(index, name, p, p.shape, p.dtype, start, end, chunk,
                                 p.requires_grad, master))
    return shards


def set_fragment(master: torch.Tensor, values: torch.Tensor, owned: int) -> None:
    """Write `owned` real elements (from a tensor of `owned` or `chunk` elements) and zero the padding."""
    flat = values.reshape(-1)
    if flat.numel() not in (owned, master.numel()):
        raise InvalidArgumentError(f"expected {owned} (or {master.numel()} padded) elements, got {flat.numel()}")
    master[:owned].copy_(flat[:owned])
    master[owned:].zero_()


def rows_to_flat(rows: torch.Tensor, flat: torch.Tensor) -> None:
    """The first flat.numel() elements of a [world, chunk] column block, into `flat`."""
    pairs = rows_to_flat_pairs(rows, flat)
    for dst, src in pairs:
        dst.copy_(src)


def rows_to_flat_pairs(rows: torch.Tensor, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """rows_to_flat's copies as (destination, source) views, for one _foreach_copy_ over many
    tensors (a GPU step launches kernels per call, not per element)."""
    world, chunk = rows.shape
    if chunk == 0:
        return []
    numel = flat.numel()
    if numel == world * chunk:  # no padding (the common case): one view, no slices
        return [(flat.view(world, chunk), rows)]
    full = min(numel // chunk, world)
    pairs = []
    if full:
        pairs.append((flat[: full * chunk].view(full, chunk), rows[:full]))
    rem = numel - full * chunk
    if rem:
        pairs.append((flat[full * chunk:], rows[full, :rem]))
    return pairs


def column_pairs(rows: torch.Tensor, chunks: list[int],
                 flats: list[torch.Tensor | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(flat part, its rows) view pairs of a bucket's [world, sum(chunks)] buffer, one column
    block per chunk, for one `_foreach_copy_` either way; a None flat is skipped. [Note: views per
    step] A GPU step of a small model is bound by Python and dispatch: the blocks come from one
    split, not a slice each."""
    blocks = rows.split(chunks, dim=1)
    return [pair for block, flat in zip(blocks, flats) if flat is not None for pair in rows_to_flat_pairs(block, flat)]
