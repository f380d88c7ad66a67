"""`zeroshard shard`: a full model into an N-rank checkpoint (weights only, no optimizer state).

Each rank file is streamed from ranged reads of the source: memory stays at one copy buffer.
Many small rank files from a local model are built a task at a time instead (shard_packed.py).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from contextlib import ExitStack

from zeroshard.errors import ZeroshardError
from zeroshard.format import RankFileResult, TensorSpec, build_manifest, rank_contents, write_rank_file
from zeroshard.format.full_model import SourceTensor, read_source_range, stripped_names
from zeroshard.format.manifest import Manifest
from zeroshard.format.output import PreparedOutput, output_transaction, prepare_output
from zeroshard.format.reader import chunk_bytes_for
from zeroshard.interop.pickled_model import open_model
from zeroshard.storage.location import Location
from zeroshard.toolkit.plans import RankFilePlans
from zeroshard.toolkit.progress import byte_bar


@output_transaction
def shard(src: str, out: str, world_size: int, *, overwrite: bool = False, storage_options: dict | None = None,
          quiet: bool = True, strip_prefix: list[str] | None = None) -> Manifest:
    """Write the model at `src` (safetensors, or a torch.save file read through the allowlist)
    as a `world_size`-rank checkpoint at `out`; returns its manifest. What of a pickle was left
    beside the model is in `manifest.extra["source_notes"]`. `strip_prefix`: tensor names lose the
    first of these prefixes they start with (DDP's `module.`, torch.compile's `_orig_mod.`)."""
    src, out = os.fspath(src), os.fspath(out)  # any os.PathLike
    if world_size < 1:
        raise ZeroshardError(f"--world must be at least 1, got {world_size}")
    folder, tensors, notes = open_model(src, storage_options)
    names = stripped_names(src, [t.name for t in tensors], strip_prefix)
    tensors = [dataclasses.replace(t, name=name) for t, name in zip(tensors, names)]
    by_name = {t.name: t for t in tensors}
    specs = [TensorSpec(t.name, "param", t.dtype, t.shape, "flat" if t.shape else "whole") for t in tensors]
    target = Location(out, storage_options)
    output = prepare_output(target, overwrite, inputs=[Location(src, storage_options)])  # docs/SAFETY.md
    checkpoint_id = uuid.uuid4().hex
    total = sum(t.end - t.begin for t in tensors)
    outputs = RankFilePlans(specs, world_size, checkpoint_id)
    from zeroshard.toolkit import shard_packed  # numpy: when a copy starts

    if shard_packed.fits(folder, output.stage, outputs):  # many small files: built a task at a time
        with byte_bar(total, f"shard -> {world_size} ranks", quiet) as bar:
            results = shard_packed.write_packed(folder, by_name, outputs, output.stage, bar.update)
        return _commit(output, specs, world_size, results, checkpoint_id, src, notes)
    with ExitStack() as stack:
        readers = {}

        def fill(spec: TensorSpec, start: int, end: int, write) -> None:
            source: SourceTensor = by_name[spec.name]
            if source.file not in readers:
                readers[source.file] = stack.enter_context(folder.open_reader(source.file, follow_links=True))

            def write_and_count(view: memoryview) -> None:
                write(view)
                bar.update(len(view))

            read_source_range(readers[source.file], source, start, end, chunk_bytes_for(folder), write_and_count)

        with byte_bar(total, f"shard -> {world_size} ranks", quiet) as bar:
            results = [write_rank_file(output.stage, checkpoint_id, rank, world_size,
                                       rank_contents(specs, world_size, rank), fill,
                                       durable=False, write_behind=True)
                       for rank in range(world_size)]
    return _commit(output, specs, world_size, results, checkpoint_id, src, notes)


def _commit(output: PreparedOutput, specs: list[TensorSpec], world_size: int, results: list[RankFileResult],
            checkpoint_id: str, src: str, notes: list | dict | None) -> Manifest:
    """The manifest vouching for the rank files, committed once they are durable."""
    manifest = build_manifest(specs, world_size, results, checkpoint_id, tag="shard",
                              extra={"source": src, **({"source_notes": notes} if notes else {})})
    output.commit_checkpoint(manifest, sync_files=True)
    return manifest
