"""Writing an Imported as a zeroshard checkpoint through the format writer.

The names, roles and manifest fields are the ones the engine's own save produces
(zeroshard/format/training_state.py), so `engine.load_checkpoint` resumes from the result as
from one of its own: `param` tensors (fp32 masters), `optimizer/{state}/{param}`, `buffer`s;
manifest.optimizer {"class", "param_groups", "scalar_state"}; manifest.extra {"engine": counters
and loss scaler, "stateful": {"lr_scheduler"}}. No RNG states: the source's are not ours.
"""

from __future__ import annotations

import uuid
from typing import Any

from zeroshard.format import (
    TensorSpec,
    build_manifest,
    commit_checkpoint,
    prepare_output_folder,
    rank_contents,
    write_rank_file,
)
from zeroshard.format.manifest import Manifest
from zeroshard.format.training_state import optimizer_key
from zeroshard.interop.imported import Imported
from zeroshard.storage.location import Location
from zeroshard.storage.safetensors_header import dtype_name


def write_imported(imp: Imported, out: str, world_size: int | None = None, *, tag: str = "imported",
                   overwrite: bool = False, storage_options: dict | None = None) -> Manifest:
    """Write `imp` as a `world_size`-rank checkpoint (default: the source's) at `out`."""
    import torch

    world = world_size or imp.world_size
    specs: list[TensorSpec] = []
    data: dict[str, Any] = {}
    for name, tensor in imp.params.items():
        shape = tuple(tensor.shape)
        layout = "flat" if shape else "whole"
        specs.append(TensorSpec(name, "param", "F32", shape, layout))
        data[name] = tensor.float().reshape(-1)
        for key, value in imp.optimizer_state.get(name, {}).items():
            specs.append(TensorSpec(optimizer_key(key, name), "optimizer", dtype_name(value.dtype), shape, layout,
                                    param=name, state=key))
            data[optimizer_key(key, name)] = value.reshape(-1)
    for name, tensor in imp.buffers.items():
        specs.append(TensorSpec(name, "buffer", dtype_name(tensor.dtype), tuple(tensor.shape), "whole"))
        data[name] = tensor.reshape(-1)

    def fill(spec: TensorSpec, start: int, end: int, write) -> None:
        part = data[spec.name][start:end].contiguous()
        write(memoryview(part.view(torch.uint8).numpy()))

    target = Location(out, storage_options)
    previous = prepare_output_folder(target, overwrite)
    checkpoint_id = uuid.uuid4().hex
    results = [write_rank_file(target, checkpoint_id, rank, world, rank_contents(specs, world, rank), fill,
                               durable=False) for rank in range(world)]
    engine = {"zero_stage": imp.zero_stage, "world_size": world, "shard_world_size": world if imp.zero_stage else 1,
              "global_steps": imp.global_steps, "micro_steps": imp.micro_steps, "skipped_steps": imp.skipped_steps,
              "loss_scaler": imp.loss_scale, "optimizer_class": (imp.optimizer_class or "").rsplit(".", 1)[-1]}
    manifest = build_manifest(
        specs, world, results, checkpoint_id, zero_stage=imp.zero_stage, step=imp.global_steps, tag=tag,
        dtypes={"compute": imp.compute_dtype, "master": "F32"},
        optimizer={"class": imp.optimizer_class, "param_groups": imp.param_groups or None,
                   "scalar_state": imp.scalar_state} if imp.optimizer_state or imp.param_groups else None,
        client_state=imp.client_state, aliases=imp.aliases,
        extra={"engine": engine, "stateful": {"lr_scheduler": imp.lr_scheduler} if imp.lr_scheduler is not None else {},
               "source": imp.source, "import_notes": imp.notes})
    commit_checkpoint(target, manifest, previous, sync_files=True)
    return manifest
