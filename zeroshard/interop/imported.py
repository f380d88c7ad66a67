"""A foreign checkpoint, in zeroshard's terms, ready for write.py.

Tensors are full (unsharded) CPU tensors, or LazyTensors that read flat element ranges from the
source on demand (so an import holds a window, not the model); whoever fills this cuts them
out of the source's own partitions. Scalars (Adam's `step`) are JSON entries like the engine's
own ({"dtype": "F32", "value": 3.0}).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable


class LazyTensor:
    """A tensor of `shape` and `dtype` whose flat elements [start, end) come from
    `read(start, end)` when asked (in the source's dtype; `.float()` casts each range)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, read: Callable[[int, int], Any],
                 cast: Any = None) -> None:
        self.shape, self._source_dtype, self._read, self._cast = tuple(shape), dtype, read, cast

    @property
    def dtype(self) -> Any:
        return self._cast or self._source_dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self._source_dtype.is_floating_point

    def float(self) -> "LazyTensor":
        import torch

        return self if self.dtype == torch.float32 else LazyTensor(self.shape, self._source_dtype, self._read,
                                                                   torch.float32)

    def reshape(self, *shape: Any) -> "LazyTensor":
        """Only the flat view (what write.py asks for): ranges are flat already."""
        if tuple(shape) not in ((-1,), ((-1,),), (self.numel(),)):
            raise NotImplementedError("a LazyTensor reshapes only to flat")  # internal: write.py reshapes to flat only
        return self

    def read(self, start: int, end: int) -> Any:
        part = self._read(start, end)
        return part if self._cast is None else part.to(self._cast)

    def materialize(self) -> Any:
        return self.read(0, self.numel()).reshape(self.shape)


def is_tensor(value: Any) -> bool:
    """A tensor or a LazyTensor."""
    import torch

    return isinstance(value, LazyTensor) or torch.is_tensor(value)


def holds_tensors(value: Any) -> bool:
    """Whether `value` holds a tensor of one or more dimensions (0-d ones are numbers in JSON).
    Callers bound the nesting first (torch_pickle.nesting_depth)."""
    if is_tensor(value):
        return value.dim() > 0
    if isinstance(value, dict):
        return any(holds_tensors(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(holds_tensors(v) for v in value)


def flat_range(value: Any, start: int, end: int) -> Any:
    """Flat elements [start, end) of a tensor or LazyTensor."""
    return value.read(start, end) if isinstance(value, LazyTensor) else value.reshape(-1)[start:end]


def materialize(value: Any) -> Any:
    """A real tensor: a LazyTensor read whole, anything else as it is."""
    return value.materialize() if isinstance(value, LazyTensor) else value


def with_shape(value: Any, shape: tuple[int, ...]) -> Any:
    """`value` (as many elements as `shape` holds) in `shape`, still unread if it was lazy."""
    if isinstance(value, LazyTensor):
        return LazyTensor(shape, value._source_dtype, value._read, value._cast)
    return value.reshape(shape)


class Flat:
    """A flat run of elements made of pieces of tensors or LazyTensors, read only when asked:
    the concatenations and slices of partitions a sharded checkpoint is cut from, without
    holding them. Each piece is (value, start, end) in flat elements; read in `dtype`."""

    def __init__(self, pieces: list[tuple[Any, int, int]], dtype: Any) -> None:
        self.pieces = [(v, s, e) for v, s, e in pieces if e > s]
        self.dtype = dtype

    @classmethod
    def of(cls, value: Any, dtype: Any = None) -> "Flat":
        return cls([(value, 0, value.numel())], dtype or value.dtype)

    @classmethod
    def cat(cls, flats: list["Flat"], dtype: Any = None) -> "Flat":
        return cls([p for f in flats for p in f.pieces], dtype or (flats[0].dtype if flats else None))

    def numel(self) -> int:
        return sum(e - s for _, s, e in self.pieces)

    def slice(self, start: int, end: int) -> "Flat":
        """Elements [start, end) (clipped to what there is)."""
        out, at = [], 0
        for value, s, e in self.pieces:
            lo, hi = max(start - at, 0), min(end - at, e - s)
            if lo < hi:
                out.append((value, s + lo, s + hi))
            at += e - s
        return Flat(out, self.dtype)

    def read(self, start: int, end: int) -> Any:
        import torch

        pieces = self.slice(start, end).pieces
        parts = [flat_range(v, s, e).to(self.dtype) for v, s, e in pieces]
        if len(parts) != 1:
            return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)
        # a LazyTensor's read is fresh; a real tensor's slice is a view, cloned so as not to hold its source
        return parts[0] if isinstance(pieces[0][0], LazyTensor) else parts[0].clone()

    def tensor(self, shape: tuple[int, ...], lazy_bytes: int) -> Any:
        """A tensor of `shape` over these elements: read now if under `lazy_bytes` or 0-d, else lazy."""
        import torch

        if math.prod(shape) * torch.empty((), dtype=self.dtype).element_size() < lazy_bytes or not shape:
            return self.read(0, self.numel()).reshape(shape)
        return LazyTensor(shape, self.dtype, self.read)


@dataclass
class Imported:
    source: str
    params: dict[str, Any]  # name -> full fp32 tensor, in the model's parameter order
    buffers: dict[str, Any] = field(default_factory=dict)
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)  # param -> state -> full tensor
    scalar_state: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # param -> state -> json
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # hyperparameters + "params": [names]
    optimizer_class: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    client_state: Any = None
    global_steps: int = 0
    micro_steps: int = 0
    skipped_steps: int = 0
    zero_stage: int = 0
    world_size: int = 1
    compute_dtype: str = "F32"
    loss_scale: dict[str, Any] = field(default_factory=lambda: {"scale": 1.0, "good_steps": 0, "hysteresis_left": 0})
    stateful: dict[str, Any] = field(default_factory=dict)  # Stateful key -> JSON state (LR schedulers)
    rank_states: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> per-rank states ("rng")
    notes: list[str] = field(default_factory=list)  # what could not be carried over, for the user


def optimizer_class_of(groups: list[dict[str, Any]], declared: str = "", notes: list[str] | None = None) -> str:
    """The torch optimizer a foreign checkpoint's param groups (or config) say it used; "unknown"
    where they cannot tell (with a line for the user in `notes`)."""
    kind = declared.lower()
    adam = bool(groups) and "amsgrad" in groups[0]  # Adam's and AdamW's own option (RAdam, NAdam have betas too)
    if kind == "adamw" or (not kind and adam and groups[0].get("decoupled_weight_decay")):
        return "torch.optim.adamw.AdamW"
    if kind == "adam" or (not kind and adam and groups[0].get("decoupled_weight_decay") is False):
        return "torch.optim.adam.Adam"
    if not kind and adam:
        # [Note: Adam or AdamW] torch releases before Adam's `decoupled_weight_decay` option
        # (2.6 and older among them: tests/data/dcp) save the same group options for both: guessing Adam
        # would record L2 regularisation for a run that decayed its weights apart from it.
        if notes is not None:
            notes.append("the param groups do not say whether the optimizer was Adam or AdamW (the torch that "
                         "saved them wrote the same options for both): its class is recorded as unknown; resume "
                         "with the one you trained with")
        return "unknown"
    if kind == "sgd" or (not kind and groups and "momentum" in groups[0]):
        return "torch.optim.sgd.SGD"
    return declared or "unknown"
