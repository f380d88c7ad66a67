"""Loading foreign `.pt` files without running their code.

torch.load(weights_only=True) only rebuilds tensors, containers and the globals on an
allowlist. DeepSpeed's optimizer files also name three of DeepSpeed's own classes; we register
small stand-ins under those exact names (a (class, "module.Name") pair in
torch.serialization.safe_globals), so DeepSpeed need not be installed and nothing else is
allowed. Any other global (a hostile `__reduce__` naming os.system, say) is refused before it
is called.
"""

from __future__ import annotations

import dataclasses
import enum
import io
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.interop import files
from zeroshard.torch_version import require_supported_torch

MAX_NESTING = 100  # containers inside containers in a foreign file: deeper is refused, not recursed into


class LossScalerStandIn:
    """deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler: plain attributes."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class ZeroStageEnumStandIn(enum.IntEnum):
    """deepspeed.runtime.zero.config.ZeroStageEnum (pickled as ZeroStageEnum(value))."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclasses.dataclass
class FragmentAddressStandIn:
    """deepspeed.utils.tensor_fragment.fragment_address."""

    numel: int = 0
    start: int = 0


STAND_INS = [
    (LossScalerStandIn, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerStandIn, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStageEnumStandIn, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddressStandIn, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def read_small_file(path: str, limit: int) -> bytes:
    """The whole of a small regular file (a FIFO or device refused, not waited on); CheckpointError
    naming `path` if it is larger than `limit` bytes. `path` may be a URL."""
    return files.read_small(path, limit)


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """How deeply dicts/lists/tuples nest in `value`, counted without recursion (stops past `limit`)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def load_pt(path: str, folder: str | None = None, limit: int | None = None, allow: tuple = ()) -> Any:
    """The object in the torch pickle at `path` (CPU tensors); CheckpointError if it names
    anything outside the allowlist or cannot be read. `folder`: the checkpoint folder `path`
    must stay inside (default: its own folder); `limit`: the most bytes it may have; `allow`:
    more globals this one file may name (rng_states.py: NumPy's, to rebuild a uint32 array)."""
    import pickle

    import torch

    raw = files.read_inside(path, folder or files.parent(path), limit)  # torch's legacy format: read whole anyway
    allowed = allowlist(allow)
    try:
        with allowed:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, AttributeError, TypeError) as exc:
        raise CheckpointError(path, f"refused to unpickle: {first_line(exc)}") from None
    except (RuntimeError, EOFError, ValueError, MemoryError, RecursionError, IndexError, KeyError) as exc:
        raise CheckpointError(path, f"not a readable torch file: {first_line(exc)}") from None
    except OSError as exc:
        raise CheckpointError(path, exc.strerror or str(exc)) from None


def allowlist(extra: tuple = ()) -> Any:
    """torch's weights_only allowlist of the stand-ins (and `extra`): a context manager to enter
    around an unpickling. It checks the torch floor first: safe_globals with (class, name) pairs is
    torch 2.6's, and below the floor it fails obscurely; so every allowlisted read refuses there."""
    import torch

    require_supported_torch()
    return torch.serialization.safe_globals([*STAND_INS, *extra])


def first_line(exc: BaseException) -> str:
    """torch's message is a page of advice; keep the line that names the offending global."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unrecognized" in line or "but got" in line:
            return line.split(" was not an allowed global", 1)[0] + (
                " (not on the allowlist)" if "was not an allowed global" in line else "")
    return lines[0] if lines else type(exc).__name__
