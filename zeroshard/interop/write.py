"""Writing an Imported as a zeroshard checkpoint through the format writer.

The names, roles and manifest fields are the ones the engine's own save produces
(zeroshard/format/training_state.py), so `engine.load_checkpoint` resumes from the result as
from one of its own: `param` tensors (fp32 masters), `optimizer/{state}/{param}`, `buffer`s;
manifest.optimizer {"class", "param_groups", "scalar_state"}; manifest.extra {"engine": counters
and loss scaler, "stateful": {key: state}}; per-rank RNG streams as rank-state blobs, written
only at the source's world size.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from zeroshard.errors import ZeroshardError
from zeroshard.format import TensorSpec, build_manifest, rank_contents, write_rank_file
from zeroshard.format.manifest import Manifest
from zeroshard.format.output import output_transaction, prepare_output
from zeroshard.format.rank_state import encode_rank_state
from zeroshard.format.training_state import optimizer_key, rank_state_key
from zeroshard.interop.imported import Imported, flat_range
from zeroshard.storage.location import Location
from zeroshard.storage.safetensors_header import dtype_name

WINDOW_BYTES = 32 << 20  # the most of one tensor read and held at once while writing


def release_large_blocks() -> None:
    """Have glibc serve blocks of 4 MiB and more by mmap, handed back to the system when freed.
    Its default raises that threshold to 32 MiB once such a block is freed, and the windows
    of a streaming import then pile up in the heap as free but resident memory (measured: peak
    RSS 722 MiB instead of 305 importing 0.5 GiB of DCP). Not glibc: nothing to do. Process-wide
    and for good, so only the `zeroshard import` commands call it, never write_imported itself: a
    training process that imports through the Python API keeps its allocator as it was."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def check_world_size(world_size: int | None) -> None:
    """Refuse a target world size below 1 (before anything is read or touched)."""
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ZeroshardError(f"--world must be at least 1, got {world_size}")


@output_transaction
def write_imported(imp: Imported, out: str, world_size: int | None = None, *, tag: str = "imported",
                   overwrite: bool = False, storage_options: dict | None = None, source: str | None = None) -> Manifest:
    """Write `imp` as a `world_size`-rank checkpoint (default: the source's) at `out`.

    Through the toolkit's output discipline (format.output, docs/SAFETY.md): `out` may not be,
    contain or lie inside `source` (the folder read), it is claimed, and the new files are staged
    and moved in only once complete, so a failure leaves the old output (if any) whole."""
    out, source = os.fspath(out), None if source is None else os.fspath(source)  # any os.PathLike
    import torch

    check_world_size(world_size)
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
    notes = list(imp.notes)
    if imp.rank_states and world == imp.world_size:  # per-rank state means something at its own world size only
        for rank, states in sorted(imp.rank_states.items()):
            blob = torch.frombuffer(bytearray(encode_rank_state(states)), dtype=torch.uint8)
            specs.append(TensorSpec(rank_state_key(rank), "extra", "U8", tuple(blob.shape), "local", owner=rank))
            data[rank_state_key(rank)] = blob
    elif imp.rank_states:
        notes.append(f"the per-rank state (RNG streams) of the source's {imp.world_size} ranks is not written: "
                     f"it means nothing at {world} ranks")

    def fill(spec: TensorSpec, start: int, end: int, write) -> None:
        value = data[spec.name]
        step = max(1, WINDOW_BYTES // torch.empty((), dtype=value.dtype).element_size())
        for lo in range(start, end, step):  # a window at a time: a lazy source is read by range, never whole
            part = flat_range(value, lo, min(end, lo + step)).contiguous()
            write(memoryview(part.view(torch.uint8).numpy()))
            del part

    target = Location(out, storage_options)
    # staged even into an empty folder: a killed import then leaves a stage `zeroshard clean`
    # removes, never rank files without a manifest
    inputs = [Location(source, storage_options)] if source else []
    output = prepare_output(target, overwrite, inputs=inputs, stage_always=True)
    checkpoint_id = uuid.uuid4().hex
    results = [write_rank_file(output.stage, checkpoint_id, rank, world, rank_contents(specs, world, rank), fill,
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
        extra={"engine": engine, "stateful": imp.stateful,
               "source": imp.source, "import_notes": notes})
    output.commit_checkpoint(manifest, sync_files=True)
    return manifest
