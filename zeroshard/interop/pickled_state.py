"""A full state dict saved with torch.save, presented as dcp_import reads a DCP folder: flat
keys, each with its path and value, so dcp_layouts.classify decides the layout alike
(FlatSource holds such entries; trainer_ddp.py fills one too).

[Note: Accelerate's FULL_STATE_DICT] FULL_STATE_DICT is the default `state_dict_type` of
Accelerate's FSDP plugin with FSDP1 (FSDP2's is SHARDED_STATE_DICT, written as DCP folders). Its
`save_state` then writes no DCP folders but two pickles on rank 0:
`pytorch_model_fsdp.bin` (the model's full state dict by FQN, tied weights under both names) and
`optimizer.bin` (FSDP's full optimizer state dict: `state` and `param_groups` by FQN). They are
read with torch_zip.load_lazy (the weights_only unpickler, tensors read by range when written)
and flattened the way DCP flattens a saved dict: `("model", fqn)`, `("optimizer", "state", fqn,
k)`, `("optimizer", "param_groups", i, k)`, a list of plain values (`betas`, `params`) being one.
"""

from __future__ import annotations

from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.interop import torch_zip
from zeroshard.interop.imported import is_tensor
from zeroshard.interop.torch_pickle import MAX_NESTING, nesting_depth


class FlatSource:
    """Entries held in memory, each under its dotted key with its path (as DCP flattens a saved
    dict), read as dcp_import reads a DCP folder's."""

    def __init__(self, folder: str) -> None:
        self.folder = folder  # what errors name (a DCP source's folder)
        self._paths: dict[str, tuple] = {}
        self._values: dict[str, Any] = {}

    def _put(self, path: str, where: tuple, value: Any) -> None:
        key = ".".join(map(str, where))
        if key in self._values:
            raise CheckpointError(path, f"two entries would both be {key!r}")
        self._paths[key], self._values[key] = where, value

    def keys(self) -> list[str]:
        return list(self._values)

    def path(self, key: str) -> tuple:
        return self._paths[key]

    def dims(self, key: str) -> int | None:
        value = self._values[key]
        return value.dim() if is_tensor(value) else None

    def read(self, key: str) -> Any:
        return self._values[key]


class PickledSource(FlatSource):
    """One torch.save'd state dict whose entries go under `head` ("model" or "optimizer")."""

    kind = "accelerate"
    world_size = 1  # rank 0 wrote the whole state

    def __init__(self, path: str, root: str, head: str) -> None:
        super().__init__(path)
        loaded = torch_zip.load_lazy(path, root)
        if not isinstance(loaded, dict):
            raise CheckpointError(path, f"holds a {type(loaded).__name__}, not a state dict")
        if nesting_depth(loaded) > MAX_NESTING:
            raise CheckpointError(path, f"nests containers more than {MAX_NESTING} deep")
        if head == "model":
            for name, value in loaded.items():
                self._put(path, (head, _name(path, name)), value)
            return
        state = loaded.get("state")
        if isinstance(state, dict) and any(isinstance(k, int) for k in state):  # optimizer.state_dict()
            raise CheckpointError(path, "keys the optimizer state by parameter index (torch's "
                                        "optimizer.state_dict()), not by name as FSDP's full optimizer state "
                                        "dict does: it cannot be matched to the parameters")
        self._flatten(path, (head,), loaded)

    def _flatten(self, path: str, prefix: tuple, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                self._flatten(path, (*prefix, key if isinstance(key, int) else _name(path, key)), inner)
        elif isinstance(value, (list, tuple)) and any(is_tensor(v) or isinstance(v, dict) for v in value):
            for index, inner in enumerate(value):
                self._flatten(path, (*prefix, index), inner)
        else:
            self._put(path, prefix, value)


def _name(path: str, key: Any) -> str:
    if not isinstance(key, str):
        raise CheckpointError(path, f"a key is a {type(key).__name__} ({str(key)[:40]!r}), not a name")
    return key
