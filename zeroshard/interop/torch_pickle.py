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
from typing import Any

from zeroshard.errors import CheckpointError


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


def load_pt(path: str) -> Any:
    """The object in the torch pickle at `path` (CPU tensors); CheckpointError if it names
    anything outside the allowlist or cannot be read."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, AttributeError, TypeError) as exc:
        raise CheckpointError(path, f"refused to unpickle: {_first_line(exc)}") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(path, f"not a readable torch file: {_first_line(exc)}") from None
    except OSError as exc:
        raise CheckpointError(path, exc.strerror or str(exc)) from None


def _first_line(exc: BaseException) -> str:
    """torch's message is a page of advice; keep the line that names the offending global."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unsupported" in line or "unrecognized" in line:
            return line.split(" was not an allowed global", 1)[0] + (
                " (not on the allowlist)" if "was not an allowed global" in line else "")
    return lines[0] if lines else type(exc).__name__
