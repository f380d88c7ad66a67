"""Stateful objects a Checkpointer saves beside the engine, and the RNG as one of them.

A Stateful is anything with `state_dict()` and `load_state_dict(state)` (DCP's protocol): an LR
scheduler, a data loader's position, the RNGs. Its `checkpoint_scope` says where its state lives:

  "global" (the default)  the same on every rank: rank 0's state_dict() is saved as JSON in the
                          manifest (extra.stateful[key]) and loaded on every rank
  "rank"                  one per rank (RNG streams, a per-rank data position): each rank's
                          state_dict() is saved in its own file, in its rank-state blob, and is
                          loaded back only when the world size is the same (at another world
                          size rank r's state has no meaning; it is skipped)

A rank-state blob (docs/FORMAT.md §9.3) is a safetensors serialization: every tensor leaf of
every per-rank state dict under `{key}/{path}`, plus `__json__`, a U8 tensor holding the JSON
of the state dicts with each tensor leaf replaced by {"__tensor__": name}. No pickles.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np
import torch

from zeroshard.errors import ArgumentTypeError, ConfigError, one_line
from zeroshard.format import training_state
from zeroshard.format.rank_state import JSON_TENSOR, decode_rank_state, encode_rank_state, parse_rank_state

__all__ = ["JSON_TENSOR", "RNGState", "Stateful", "decode_rank_state", "encode_rank_state", "name_stateful",
           "one_line", "parse_rank_state", "restoring", "scope_of", "to_json_value"]


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def scope_of(obj: Any) -> str:
    scope = getattr(obj, "checkpoint_scope", "global")
    if scope not in ("global", "rank"):
        raise ConfigError(f"{type(obj).__name__}.checkpoint_scope must be 'global' or 'rank', not {scope!r}")
    return scope


def name_stateful(positional: tuple[Any, ...], named: Mapping[str, Any]) -> dict[str, Any]:
    """Keys for the Stateful objects given to a Checkpointer: by keyword, by their
    `checkpoint_key` attribute, or "lr_scheduler" for a torch LR scheduler."""
    out: dict[str, Any] = {}
    for obj in positional:
        key = getattr(obj, "checkpoint_key", None)
        if key is None and isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            key = "lr_scheduler"
        if key is None:
            raise ArgumentTypeError(f"cannot tell under which name to save a {type(obj).__name__}: pass it by keyword "
                            f"(Checkpointer(engine, name=obj)) or give it a `checkpoint_key` attribute")
        if key in out:
            raise ConfigError(f"two stateful objects would be saved as {key!r}: pass them by keyword")
        out[key] = obj
    for key, obj in named.items():
        if key in out:
            raise ConfigError(f"two stateful objects would be saved as {key!r}")
        out[key] = obj
    for key, obj in out.items():
        if not isinstance(obj, Stateful):
            raise ArgumentTypeError(f"{key!r}: a {type(obj).__name__} has no state_dict()/load_state_dict()")
        if not key or "/" in key:
            raise ConfigError(f"stateful key {key!r} must be a non-empty name without '/'")
        scope_of(obj)
    return out


class RNGState:
    """The RNG streams of this process: torch (CPU, and the engine's CUDA device), Python's
    `random` and NumPy's global generator. Saved per rank; restored at the same world size."""

    checkpoint_key = "rng"
    checkpoint_scope = "rank"

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        }
        if self.device is not None and self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "torch" in state:
            torch.set_rng_state(state["torch"])
        if "cuda" in state and self.device is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)
        if "python" in state:
            py = state["python"]
            random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        if "numpy" in state:
            npy = state["numpy"]
            np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                                 npy["cached_gaussian"]))


def to_json_value(value: Any, what: str) -> Any:
    """Hyperparameters, counters and Stateful states as plain JSON (format.training_state)."""
    return training_state.to_json_value(value, what, _TENSOR_HINT)


_TENSOR_HINT = ' (global states are JSON in the manifest; an object with checkpoint_scope = "rank" may hold tensors)'


def restoring(key: str, obj: Any, rank: int, exc: BaseException) -> str:
    """What went wrong when `obj` (saved under `key`) rejected its state on `rank`, in one line."""
    return f"rank {rank}: restoring {key!r} ({type(obj).__name__}.load_state_dict) failed: {one_line(exc)}"
