"""Hugging Face Trainer checkpoints written without DeepSpeed or FSDP (DDP, or one process),
presented as dcp_import reads a DCP folder: `("model", fqn)` from the weights file,
`("optimizer", "state", fqn, k)` and `("optimizer", "param_groups", i, k)` from optimizer.pt.

The folder (`checkpoint-N/`): `model.safetensors` (or an index and its shards), `optimizer.pt`
(torch's optimizer.state_dict()), `scheduler.pt`, `rng_state_{r}.pth`, `trainer_state.json`,
`training_args.bin`, `config.json` (beside.py carries the scheduler, RNG and trainer state).

[Note: parameter order] optimizer.pt keys its state and param groups by parameter *index*,
numbered in the order the Trainer built its groups (`Trainer.create_optimizer`): the parameters
with weight decay, then those without, each in `model.named_parameters()` order. The weights
file names the parameters but not that order, and several share a shape (q/o, k/v, gate/up
projections), so shapes cannot tell them apart. The order comes from the model class itself:
built from config.json on the meta device by transformers, and only by the transformers release
that saved the checkpoint, patch level aside (another may register modules in another order,
and the Trainer's weight-decay rule has changed over releases). Even then every group's size and every
state's shape must agree, or the import is refused; a refusal says how to take the weights alone.
"""

from __future__ import annotations

import json
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.format.full_model import (
    HF_INDEX_NAME,
    HF_SINGLE_NAME,
    SourceTensor,
    open_full_model,
    read_source_tensor,
)
from zeroshard.interop import files, torch_zip
from zeroshard.interop.imported import LazyTensor, is_tensor
from zeroshard.interop.pickled_state import FlatSource
from zeroshard.interop.rng_states import rng_files
from zeroshard.interop.torch_pickle import MAX_NESTING, nesting_depth

OPTIMIZER = "optimizer.pt"
CONFIG = "config.json"
MAX_CONFIG_BYTES = 4 * 1024 * 1024
ADAM_STATE = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}  # adamw_torch(_fused), adamw_torch with amsgrad
# read here, or (weights files) through the index; beside.py takes the rest
OWN = (OPTIMIZER, CONFIG, "generation_config.json", HF_SINGLE_NAME, HF_INDEX_NAME)


def weights_only_hint(folder: str) -> str:
    return f"`zeroshard shard {folder} OUT --world N` takes the weights alone, with a fresh optimizer"


class TrainerSource(FlatSource):
    """The model and optimizer of a Trainer checkpoint folder, by name (see the module notes)."""

    kind = "trainer"

    def __init__(self, folder: str, names: list[str]) -> None:
        super().__init__(folder)
        # the processes that saved it: one RNG file each (beside.py carries them at that world size)
        self.world_size = len(rng_files(names)) or 1
        weights = self._weights()
        order = parameter_order(folder, names)
        optimizer_path = files.join(folder, OPTIMIZER)
        saved = torch_zip.load_lazy(optimizer_path, folder)
        if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
                or not isinstance(saved.get("param_groups"), list) or nesting_depth(saved) > MAX_NESTING:
            raise CheckpointError(optimizer_path, "not torch's optimizer state_dict (state, param_groups)")
        self._fill(optimizer_path, saved, weights, match_indices(optimizer_path, saved, order, weights, folder))

    def _fill(self, optimizer_path: str, saved: dict, weights: dict[str, LazyTensor], by_index: dict[int, str]) -> None:
        """The weights, and the optimizer's state and groups by parameter name (`by_index`)."""
        for name, value in weights.items():
            self._put(self.folder, ("model", name), value)
        for index, per_param in saved["state"].items():
            for key, value in per_param.items():
                self._put(optimizer_path, ("optimizer", "state", by_index[index], key), value)
        for g, group in enumerate(saved["param_groups"]):
            for key, value in group.items():
                if key != "param_names":  # torch's own names of `params` (a named optimizer): `params` has them
                    self._put(optimizer_path, ("optimizer", "param_groups", g, key),
                              [by_index[i] for i in value] if key == "params" else value)

    def _weights(self) -> dict[str, LazyTensor]:
        from zeroshard.storage.safetensors_header import torch_dtype

        location, tensors = open_full_model(self.folder, files.options())
        out = {}
        for t in tensors:
            def read(start: int, end: int, t: SourceTensor = t) -> Any:
                with location.open_reader(t.file, follow_links=True) as reader:
                    return read_source_tensor(reader, t, start, end)
            out[t.name] = LazyTensor(t.shape, torch_dtype(t.dtype), files.bound(read))
        return out


def parameter_order(folder: str, names: list[str]) -> tuple[list[str], list[str]]:
    """The Trainer's two param groups, names in order (weight decay, then none), from the model
    class built on the meta device; refused unless the transformers that saved it is installed."""
    path = files.join(folder, CONFIG)
    refuse = f"; {weights_only_hint(folder)}"
    if CONFIG not in names:
        raise CheckpointError(files.join(folder, OPTIMIZER), "keys its state by parameter index, and without the "
                                                             f"model's {CONFIG} the order cannot be known{refuse}")
    if "adapter_config.json" in names:
        raise CheckpointError(files.join(folder, OPTIMIZER), f"a PEFT model's optimizer: not supported{refuse}")
    try:
        config = json.loads(files.read_inside(path, folder, MAX_CONFIG_BYTES).decode("utf-8"))
        architectures, saved_by = config["architectures"], config["transformers_version"]
        assert isinstance(architectures, list) and len(architectures) == 1 and isinstance(saved_by, str)
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
        raise CheckpointError(path, "not a transformers config with one `architectures` entry and the "
                                    f"`transformers_version` that saved it{refuse}") from None
    if "auto_map" in config:
        raise CheckpointError(path, f"a model with its own code (auto_map): its parameter order is not known here"
                                    f"{refuse}")
    try:
        import torch
        import transformers
    except ImportError:
        raise CheckpointError(path, f"reading optimizer.pt needs transformers {saved_by}, which saved it (pip "
                                    f"install 'transformers=={saved_by}'){refuse}") from None
    if _minor(transformers.__version__) != _minor(saved_by):  # patch releases do not move modules
        raise CheckpointError(path, f"saved by transformers {saved_by}, and {transformers.__version__} is "
                                    "installed: another version may order the parameters otherwise (pip install "
                                    f"'transformers=={saved_by}'){refuse}")
    try:
        kind = getattr(transformers, architectures[0])
        settings = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
        with torch.device("meta"):
            model = kind(transformers.AutoConfig.for_model(**settings))
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    except Exception as exc:  # noqa: BLE001 - whatever the model's own code raises, said in one line
        raise CheckpointError(path, f"could not build {architectures[0]} from it to learn the parameter order "
                                    f"({type(exc).__name__}: {str(exc)[:120]}){refuse}") from None
    ordered = [n for n, _ in model.named_parameters()]  # what Trainer.create_optimizer iterates
    return [n for n in ordered if n in decay], [n for n in ordered if n not in decay]


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def match_indices(path: str, saved: dict, order: tuple[list[str], ...], weights: dict[str, LazyTensor],
                  folder: str, other: str = "the Trainer's `optim` was another",
                  wrong_order: str = "the order is not the model's") -> dict[int, str]:
    """Parameter index -> name, checked: the groups' sizes, every state's shape (see the notes);
    `other` and `wrong_order` say in a refusal why the optimizer or the order may be another's."""
    groups = saved["param_groups"]
    refuse = f"; {weights_only_hint(folder)}"
    sizes = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else -1 for g in groups]
    if sizes != [len(o) for o in order]:
        raise CheckpointError(path, f"param groups of {sizes} parameters, where the Trainer's default optimizer has "
                                    f"{[len(o) for o in order]} (weight decay, none): another optimizer, or frozen "
                                    f"parameters, whose order cannot be known{refuse}")
    by_index: dict[int, str] = {}
    for group, names in zip(groups, order):
        for index, name in zip(group["params"], names):
            if not isinstance(index, int) or index in by_index:
                raise CheckpointError(path, f"param group index {index!r} is not a new integer")
            by_index[index] = name
    for index, per_param in saved["state"].items():
        name = by_index.get(index)
        if name is None or not isinstance(per_param, dict):
            raise CheckpointError(path, f"state of parameter index {index!r}, which no param group holds")
        unknown = sorted(map(str, set(per_param) - ADAM_STATE))
        if unknown:  # Adafactor's factored moments, an 8-bit optimizer's quantized ones, ...
            raise CheckpointError(path, f"state {', '.join(unknown)} of parameter index {index}: not torch's "
                                        f"Adam/AdamW ({other}){refuse}")
        if name not in weights:
            raise CheckpointError(path, f"parameter {name!r} (index {index}) is not in the weights file")
        for key, value in per_param.items():
            if is_tensor(value) and value.dim() >= 1 and tuple(value.shape) != tuple(weights[name].shape):
                raise CheckpointError(path, f"state {key!r} of index {index} has shape {list(value.shape)}, but the "
                                            f"model's parameter {index} is {name!r} of {list(weights[name].shape)}: "
                                            f"{wrong_order}{refuse}")
    return by_index
