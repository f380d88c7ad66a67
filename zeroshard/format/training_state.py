"""How a training engine's state is named in a checkpoint (docs/FORMAT.md §9): one place for the
engine's checkpointer, the importers (zeroshard/interop) and any reader.

Tensors:
  `{param}`                    role "param": the fp32 master weights (layout flat, or whole if 0-d)
  `optimizer/{state}/{param}`  role "optimizer": per-element optimizer state (Adam's exp_avg, ...)
  `{buffer}`                   role "buffer": a module buffer, stored once (rank 0's file)
  `rank-state/rank-{r:05d}`    role "extra", layout local, owner r: rank r's own state (its RNG,
                               per-rank Stateful objects) as a safetensors blob (§9.3)
Manifest:
  optimizer    {"class", "param_groups": [{hyperparameters..., "params": [names]}],
                "scalar_state": {param: {state: {"dtype"?, "value"}}}}
  extra.engine {"zero_stage", "world_size", "shard_world_size", "global_steps", "micro_steps",
                "skipped_steps", "loss_scaler", "optimizer_class"}
  extra.stateful {key: JSON state_dict} of every global Stateful object ("lr_scheduler", ...)
Read but no longer written (checkpoints of earlier versions): extra.lr_scheduler (now
extra.stateful.lr_scheduler), `rng/rank-{r:05d}/{cpu|cuda}` tensors with extra.rng (now rank-state).
"""

from __future__ import annotations

from typing import Any, Iterable

from zeroshard.errors import ArgumentTypeError

RANK_STATE_PREFIX = "rank-state/"
LEGACY_RNG_PREFIX = "rng/"
ENGINE_COUNTERS = ("global_steps", "micro_steps", "skipped_steps")  # extra.engine, in Counters' order


def optimizer_key(state: str, param: str) -> str:
    return f"optimizer/{state}/{param}"


def rank_state_key(rank: int) -> str:
    return f"{RANK_STATE_PREFIX}rank-{rank:05d}"


def legacy_rng_key(rank: int, device: str) -> str:
    """Checkpoints written before rank-state blobs kept torch RNG states under these names."""
    return f"{LEGACY_RNG_PREFIX}rank-{rank:05d}/{device}"


def ranks_with_rank_state(names: Iterable[str]) -> int:
    """How many ranks saved per-rank state, among a manifest's tensor `names` (rank-state blobs,
    or an older checkpoint's RNG tensors)."""
    return len({n.split("/")[1] for n in names if n.startswith((RANK_STATE_PREFIX, LEGACY_RNG_PREFIX))})


def global_stateful_keys(extra: dict[str, Any]) -> list[str]:
    """The keys of every global Stateful state saved in a manifest's `extra`."""
    saved = extra.get("stateful")
    keys = [str(k) for k in saved] if isinstance(saved, dict) else []
    return keys + (["lr_scheduler"] if extra.get("lr_scheduler") is not None and "lr_scheduler" not in keys else [])


def global_stateful(extra: dict[str, Any], key: str) -> Any:
    """The saved state of global Stateful `key`, or None (older checkpoints: extra.lr_scheduler)."""
    saved = (extra.get("stateful") or {}).get(key)
    if saved is None and key == "lr_scheduler":
        saved = extra.get("lr_scheduler")
    return saved


def to_json_value(value: Any, what: str, tensor_hint: str = "") -> Any:
    """Hyperparameters, counters and states as plain JSON (tuples -> lists, 0-d tensors ->
    numbers); a TypeError naming `what` and the type otherwise (`tensor_hint` added for a tensor).
    Shared by the engine's checkpointer and the importers."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, what, tensor_hint) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json_value(v, what, tensor_hint) for k, v in value.items()}
    is_tensor = _is_tensor(value)
    if is_tensor and value.dim() == 0:
        return value.item()
    shown = " ".join(str(value)[:200].split())[:80]  # one line: a tensor's repr spans several
    raise ArgumentTypeError(f"{what}: {type(value).__name__} value {shown} cannot be stored as JSON"
                    f"{tensor_hint if is_tensor else ''}")


def scalar_json(value: Any, what: str) -> dict[str, Any]:
    """A scalar optimizer state (Adam's `step`) as the manifest stores it, keeping a tensor's dtype."""
    if _is_tensor(value):
        from zeroshard.storage.safetensors_header import dtype_name

        return {"dtype": dtype_name(value.dtype), "value": value.item()}
    return {"value": to_json_value(value, what)}


def _is_tensor(value: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")  # a tensor exists only where torch is imported: never import it here
    return torch is not None and torch.is_tensor(value)

