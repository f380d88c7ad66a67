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


    raw = files.read_inside(path, folder or files.parent(path), limit)  # torch's legacy format: read whole anyway
    allowed = allowlist(allow)
    try:
        with allowed:
            return checked_load(path, raw)
    except (pickle.UnpicklingError, AttributeError, TypeError) as exc:
        raise CheckpointError(path, f"refused to unpickle: {first_line(exc)}") from None
    except (RuntimeError, EOFError, ValueError, MemoryError, RecursionError, IndexError, KeyError) as exc:
        raise CheckpointError(path, f"not a readable torch file: {first_line(exc)}") from None
    except OSError as exc:
        raise CheckpointError(path, exc.strerror or str(exc)) from None


def checked_load(path: str, raw: bytes) -> Any:
    """torch.load(weights_only=True) of the file `path` whose bytes are `raw` (inside `allowlist()`),
    with the sizes it declares checked against the bytes it holds: in torch's legacy (not zip)
    format torch allocates each storage's declared size before reading a byte, so those are
    checked first on meta storages; a view (stride 0, overlapping strides) may not declare more
    elements than its storage holds, or the first copy of it would allocate them. CheckpointError
    naming `path`; torch's own errors pass through."""
    import torch

    if raw[:4] != b"PK\x03\x04":
        _check_legacy_sizes(path, raw)
    value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    check_views(path, value)
    return value


def _check_legacy_sizes(path: str, raw: bytes) -> None:
    """The storages a legacy-format torch file declares fit in its bytes: its pickle is run once
    with meta storages (no bytes allocated) to add up what each declares."""
    import pickle

    import torch
    from torch import _weights_only_unpickler

    stream = io.BytesIO(raw)
    declared: dict[Any, int] = {}

    def persistent_load(saved_id: Any) -> Any:
        kind = saved_id[0].decode("ascii") if isinstance(saved_id, tuple) and isinstance(saved_id[0], bytes) \
            else saved_id[0] if isinstance(saved_id, tuple) and saved_id else None
        if kind == "module" and len(saved_id) >= 2:
            return saved_id[1]
        if kind != "storage" or len(saved_id) != 6:
            raise pickle.UnpicklingError(f"unexpected storage reference {str(saved_id)[:60]}")
        storage_type, key, _, numel, _ = saved_id[1:]
        dtype = getattr(storage_type, "dtype", None)
        if not isinstance(dtype, torch.dtype) or isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError(f"unexpected storage reference {str(saved_id)[:60]}")
        nbytes = numel * torch._utils._element_size(dtype)
        declared[key] = max(declared.get(key, 0), nbytes)
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype,
                                          _internal=True)

    for _ in range(3):  # magic number, protocol version, system info
        _weights_only_unpickler.Unpickler(stream, encoding="utf-8").load()
    unpickler = _weights_only_unpickler.Unpickler(stream, encoding="utf-8")
    unpickler.persistent_load = persistent_load
    unpickler.load()
    total = sum(declared.values())
    if total > len(raw):
        raise CheckpointError(path, f"its storages declare {total} bytes but the file holds {len(raw)}: refused "
                                    "before allocating them")


def check_views(path: str, value: Any) -> None:
    """CheckpointError naming `path` if a tensor in `value` declares more bytes (elements x size)
    than its storage holds: a stride-0 or overlapping view, which any copy would blow up."""
    import torch

    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if torch.is_tensor(item):
            if item.layout == torch.strided:
                declared, held = item.numel() * item.element_size(), item.untyped_storage().nbytes()
                if declared > held:
                    raise CheckpointError(path, f"a tensor of shape {list(item.shape)} declares {declared} bytes "
                                                f"over a storage of {held} (a stride-0 or overlapping view): refused "
                                                "before allocating")
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, (type, enum.Enum)):
            stack.extend(vars(item).values())


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
