"""Rank-state blobs (docs/FORMAT.md §9.3): one rank's per-rank Stateful states (its RNG streams,
a per-rank data position) as the bytes of a safetensors file, no pickles. Written by the
engine's checkpointer and by imports that carry a source's per-rank state; read by the load."""

from __future__ import annotations

import json
from typing import Any, Mapping

from zeroshard.errors import InvalidArgumentError, one_line
from zeroshard.format.training_state import to_json_value

JSON_TENSOR = "__json__"


def encode_rank_state(states: Mapping[str, dict[str, Any]]) -> bytes:
    """This rank's per-rank Stateful states as one safetensors blob: every tensor leaf (of one or
    more dimensions) under `{key}/{path}`, and the JSON tree, leaves replaced by {"__tensor__": name}."""
    import torch
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


def _resolve(value: Any, tensors: dict[str, Any]) -> Any:
    """The JSON tree with each {"__tensor__": name} replaced by that tensor."""
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            if value["__tensor__"] not in tensors:
                raise ValueError(  # internal: caught in parse_rank_state, reported as a malformed blob
                    f"names a missing tensor {value['__tensor__']!r}")
            return tensors[value["__tensor__"]]
        return {k: _resolve(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, tensors) for v in value]
    return value
