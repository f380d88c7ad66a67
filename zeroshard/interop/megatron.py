"""Megatron-Core's `dist_checkpointing` folders in its `torch_dist` format (NeMo's and
Megatron-LM's default), read without megatron, torch.distributed or a process group.

The folder: `metadata.json` ({"sharded_backend": "torch_dist", ...}), DCP's `.metadata` and the
`__<rank>_<n>.distcp` files. Megatron saves through DCP, so the reading is DCP's
(dcp_metadata.py, dcp_chunks.py): its `.metadata` also keeps every rank's SavePlan (stand-ins
there), and each tensor-parallel split is a DCP chunk, so the chunks join into whole tensors.
The keys are the model's sharded state dict keys: a homogeneous TransformerBlock stacks its
layers on a leading axis (`decoder.layers.mlp.linear_fc1.weight` of shape [layers, ...]), kept
as one tensor by default, or cut into `decoder.layers.{i}.…` (what the live module's
state_dict() names) with `split_layers`. Bytes entries: `common_state/shard_0_1` holds the
common state (iteration, checkpoint_version; older releases wrote it to `common.pt`), read
through the allowlist; `…/_extra_state/shard_{layer}_{layers}` and anything else are named in
the import's notes. Optimizer state (`optimizer.…`, the distributed optimizer's
`optimizer.distributed.…`) is refused: its layout is Megatron's own flattened buffers.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.interop import dcp_chunks, files
from zeroshard.interop.dcp_metadata import load_metadata
from zeroshard.interop.imported import Imported, LazyTensor, flat_range
from zeroshard.interop.source import Option, Source
from zeroshard.interop.torch_pickle import load_pt
from zeroshard.storage.location import Location

METADATA_JSON, COMMON_KEY, COMMON_PT = "metadata.json", "common_state", "common.pt"
MAX_JSON_BYTES = 1 << 20
_SHARD = re.compile(r"(.*)/shard_(\d+(?:\.\d+)*)_(\d+(?:\.\d+)*)")  # a ShardedObject: key/shard_<offset>_<shape>
_STACKED = re.compile(r"(^|.*\.)layers\.(?!\d+\.)(.+)")  # decoder.layers.<rest>, not decoder.layers.3.<rest>


def backend_of(folder: str) -> str | None:
    """The `sharded_backend` metadata.json names, None when there is no metadata.json."""
    path = files.join(folder, METADATA_JSON)
    if not files.isfile(path):
        return None
    try:
        config = json.loads(files.read_inside(path, folder, MAX_JSON_BYTES, METADATA_JSON))
    except ValueError as exc:
        raise CheckpointError(path, f"not JSON: {exc}") from None
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if not isinstance(backend, str):
        raise CheckpointError(path, "no sharded_backend: not a Megatron-Core dist checkpoint's metadata.json")
    return backend


def _common(folder: str, metadata: Any, chunks: dict, notes: list[str]) -> dict[str, Any]:
    """The common state: DCP's `common_state/shard_0_1` entry, or `common.pt` beside it."""
    key = next((k for k in metadata.state_dict_metadata if k.split("/")[0] == COMMON_KEY), None)
    try:
        if key is not None:
            value = dcp_chunks.read_blob(folder, _storage(folder, chunks, key), key)
            value = value[0] if isinstance(value, list) and len(value) == 1 else value  # a ShardedObject's list
        elif files.isfile(files.join(folder, COMMON_PT)):
            value = load_pt(files.join(folder, COMMON_PT), folder)
        else:
            return {}
    except CheckpointError as exc:  # e.g. Megatron-LM's pickled `args` Namespace: the weights still import
        notes.append(f"common state not read ({exc.problem[:200]}): the iteration is unknown, step 0 recorded")
        return {}
    return value if isinstance(value, dict) else {}


def _storage(folder: str, chunks: dict, key: str) -> Any:
    info = chunks.get((key, None)) or next((i for (k, _), i in chunks.items() if k == key), None)
    if info is None:
        raise CheckpointError(folder, f"{key}: no storage entry")
    return info


def _layer(value: Any, i: int) -> Any:
    """Layer `i` of a tensor stacked on its leading axis, still unread if it was lazy."""
    if not isinstance(value, LazyTensor):
        return value[i]
    row = math.prod(value.shape[1:])
    return LazyTensor(value.shape[1:], value.dtype, lambda s, e: flat_range(value, i * row + s, i * row + e))


def _shown(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def read_megatron(src: str, split_layers: bool = False, storage_options: dict | None = None) -> Imported:
    """Read the Megatron-Core torch_dist checkpoint folder `src` (local or s3://). Stacked layers
    stay one [layers, ...] tensor unless `split_layers` names them `…layers.{i}.…`."""
    src = os.fspath(src)
    with files.storage_options(storage_options):
        return _read(src.rstrip("/") or "/", split_layers)


def recognise(location: Location, names: list[str]) -> str | None:
    """A folder whose metadata.json names a `sharded_backend` (its `.metadata` makes it a DCP
    folder too: sources.py asks this source first). Another backend than torch_dist is still
    Megatron's: its import says what to do."""
    if METADATA_JSON not in names:
        return None
    config = json.loads(location.read_bytes(METADATA_JSON, 0, MAX_JSON_BYTES))
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    return f"a Megatron-Core dist checkpoint ({backend[:40]})" if isinstance(backend, str) else None


SOURCE = Source(
    name="megatron", label="Megatron-Core", recognise=recognise, read=read_megatron,
    options=(Option(("--split-layers", "split_layers"), kind="flag", help="Cut stacked layer tensors [layers, ...] "
                    "into decoder.layers.{i}.… (default: kept stacked)."),),
    world_help="Ranks to write for (default: the source's, one per .distcp file).",
    help="""A Megatron-Core dist_checkpointing folder in its torch_dist format (metadata.json,
    .metadata, __*_*.distcp: what NeMo and Megatron-LM save by default), model weights only.

    Tensor-parallel (and pipeline-parallel) pieces are joined into whole tensors; the layers a
    TransformerBlock stacks on a leading axis stay one [layers, ...] tensor unless
    --split-layers names them decoder.layers.{i}.… as the module's state_dict() does. The
    iteration becomes the step; _extra_state entries are listed, not imported; optimizer state
    is refused. SRC and OUT may be local or s3://.
    """)


def _read(folder: str, split_layers: bool) -> Imported:
    if not files.isdir(folder):
        raise CheckpointError(folder, "no such Megatron-Core checkpoint folder")
    backend = backend_of(folder)
    if backend is None:
        raise CheckpointError(folder, f"not a Megatron-Core dist checkpoint: no {METADATA_JSON}")
    if backend != "torch_dist":
        raise CheckpointError(files.join(folder, METADATA_JSON),
                              f"sharded_backend {backend[:40]!r}: only Megatron-Core's torch_dist format is read "
                              "(convert it with megatron's dist_checkpointing to torch_dist first)")
    metadata = load_metadata(files.join(folder, ".metadata"))
    storage = getattr(metadata, "storage_data", None) or {}
    chunks = {(index.fqn, tuple(index.offset) if index.offset is not None else None): info
              for index, info in storage.items()}
    entries = metadata.state_dict_metadata
    optimizer = [k for k in entries if k.split(".")[0] == "optimizer"]
    if optimizer:
        which = "the distributed optimizer's" if any(k.startswith("optimizer.distributed.") for k in optimizer) \
            else "Megatron's optimizer"
        raise CheckpointError(folder, f"{which} state ({len(optimizer)} entries, e.g. {optimizer[0]}) is not "
                                      "read: import a checkpoint saved without it (Megatron-LM's --no-save-optim)")
    notes: list[str] = []
    common = _common(folder, metadata, chunks, notes)
    tensors: dict[str, Any] = {}
    place: dict[str, tuple[int, int, int]] = {}  # split layers in the module's order: layer by layer
    first: dict[str, int] = {}
    extra: dict[str, int] = {}
    other: list[str] = []
    stacked = 0
    for at_key, (key, entry) in enumerate(entries.items()):
        if type(entry).__name__ != "TensorStorageMetadata":
            if key.split("/")[0] == COMMON_KEY:
                continue
            shard = _SHARD.fullmatch(key)
            base = shard.group(1) if shard else key
            if base.endswith("_extra_state"):
                extra[base] = extra.get(base, 0) + 1  # one entry per layer of a stacked block
            else:
                other.append(key)
            continue
        value = dcp_chunks.tensor(folder, key, entry, chunks)
        layer = _STACKED.fullmatch(key)
        if split_layers and layer and value.dim() >= 1:
            stacked += 1
            block = first.setdefault(layer.group(1), at_key)
            for i in range(value.shape[0]):
                name = f"{layer.group(1)}layers.{i}.{layer.group(2)}"
                tensors[name], place[name] = _layer(value, i), (block, i, at_key)
        else:
            stacked += bool(layer)
            tensors[key], place[key] = value, (at_key, 0, 0)
    tensors = {name: tensors[name] for name in sorted(tensors, key=place.__getitem__)}

    imp = Imported(source=f"megatron:{files.absolute(folder)}", params={}, zero_stage=3,
                   world_size=len({i.relative_path for i in storage.values()}) or 1)
    for name, value in tensors.items():
        if value.is_floating_point():
            imp.params[name] = value.float()
        else:
            imp.buffers[name] = value
    iteration = common.get("iteration")
    imp.global_steps = imp.micro_steps = iteration if isinstance(iteration, int) and iteration >= 0 else 0
    version = common.get("checkpoint_version")
    notes.insert(0, f"Megatron-Core torch_dist checkpoint (checkpoint_version {version}, iteration {iteration}): "
                    f"{len(imp.params)} parameter(s) joined from their tensor-parallel chunks; weights only, the "
                    "engine's optimizer starts fresh")
    if stacked:
        notes.append(f"{stacked} stacked layer tensor(s) " + (
            "cut into per-layer names (…layers.{i}.…)" if split_layers else
            "kept as one tensor with a leading layer axis (`zeroshard import megatron --split-layers` names them "
            "…layers.{i}.… as the module's state_dict() does)"))
    if imp.buffers:
        notes.append(f"non-floating tensors imported as buffers: {_shown(list(imp.buffers))}")
    if extra:  # every one named (by its stacked key): they are few, one per module kind
        notes.append(f"not imported: {sum(extra.values())} _extra_state entries (modules' extra state, Transformer "
                     "Engine's FP8 scaling among it, rebuilt by a fresh module): "
                     + ", ".join(f"{k} (x{n})" if n > 1 else k for k, n in extra.items()))
    if other:
        notes.append(f"not imported (not model weights): {_shown(other)}")
    own = {METADATA_JSON, ".metadata", COMMON_PT} | {i.relative_path for i in storage.values()}
    beside = sorted(n for n in files.listdir(folder) if n not in own)
    if beside:
        notes.append(f"not imported, beside the checkpoint: {_shown(beside)}")
    unknown = [k for k in common if k not in ("iteration", "checkpoint_version")]
    if unknown:
        notes.append(f"common state not imported: {_shown(sorted(map(str, unknown)))}")
    imp.notes.extend(notes)
    return imp

