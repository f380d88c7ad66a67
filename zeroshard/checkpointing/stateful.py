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

import json
import random
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np
import torch

from zeroshard.errors import ArgumentTypeError, ConfigError, InvalidArgumentError
from zeroshard.format import training_state

JSON_TENSOR = "__json__"


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


def encode_rank_state(states: Mapping[str, dict[str, Any]]) -> bytes:
    """This rank's per-rank Stateful states as one safetensors blob (see the module docstring)."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if torch.is_tensor(value) and value.dim() > 0:
            tensors[path] = value.detach().to("cpu").contiguous().clone()
            return {"__tensor__": path}
        if isinstance(value, dict):
            return {str(k): walk(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        return to_json_value(value, f"state of {path.split('/')[0]!r}")

    tree = {key: walk(state, key) for key, state in states.items()}
    tensors[JSON_TENSOR] = torch.frombuffer(bytearray(json.dumps(tree).encode()), dtype=torch.uint8)
    return save(tensors)


def decode_rank_state(blob: bytes, where: str) -> dict[str, Any]:
    """The per-rank states saved by encode_rank_state; ValueError naming `where` if malformed."""
    try:
        return parse_rank_state(blob)
    except ValueError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from None


def parse_rank_state(blob: bytes) -> dict[str, Any]:
    """decode_rank_state without a name: ValueError("malformed rank-state blob (...)"), one line."""
    from safetensors.torch import load

    try:
        tensors = load(blob)
        tree = json.loads(bytes(tensors.pop(JSON_TENSOR).numpy()).decode())
        if not isinstance(tree, dict):
            raise ValueError("its JSON is not an object")  # internal: caught below, reported as a malformed blob
        return {str(key): _resolve(state, tensors) for key, state in tree.items()}
    except Exception as exc:  # any malformation of the blob (absurd nesting included): one message
        raise InvalidArgumentError(f"malformed rank-state blob ({one_line(exc)})") from None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` of an exception, cut to its first line and `limit` characters: a user's
    load_state_dict may raise anything, and the error that reports it must stay one line."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > limit:
        first = first[:limit - 3] + "..."
    more = " ..." if first and len(text.splitlines()) > 1 else ""
    return f"{type(exc).__name__}: {first}{more}" if first else type(exc).__name__


def restoring(key: str, obj: Any, rank: int, exc: BaseException) -> str:
    """What went wrong when `obj` (saved under `key`) rejected its state on `rank`, in one line."""
    return f"rank {rank}: restoring {key!r} ({type(obj).__name__}.load_state_dict) failed: {one_line(exc)}"


def _resolve(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON tree with each {"__tensor__": name} replaced by that tensor."""
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            if value["__tensor__"] not in tensors:
                raise ValueError(  # internal: caught in decode_rank_state, reported as a malformed blob
                    f"names a missing tensor {value['__tensor__']!r}")
            return tensors[value["__tensor__"]]
        return {k: _resolve(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, tensors) for v in value]
    return value
