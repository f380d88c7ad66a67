"""The remote executor of a plan (zeroshard.toolkit.plan): each output written front to back into
an object store, one file at a time, the plan's pieces read through CheckpointReader.iter_planned
(the whole read list known up front, so many ranged GETs are in flight; fragments read front to
back are hash-checked). An object has one writer, so work splits by whole outputs (Plan.split).
Local outputs take the local executor instead (zeroshard.toolkit.transfer).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from zeroshard.format import CheckpointReader, RankFileResult, write_rank_file
from zeroshard.format.manifest import Manifest
from zeroshard.partition_arrays import shard_ranges
from zeroshard.storage.location import Location
from zeroshard.storage.stream_writer import SafetensorsStreamWriter
from zeroshard.toolkit.plan import Plan


def stream_outputs(source: Location, manifest: Manifest, target: Location, plan: Plan,
                   progress: Callable[[int], None] | None = None) -> list[RankFileResult]:
    """Write every output `plan` describes (a size: split parts describe only theirs), in order;
    returns the rank files' results (none for model files)."""
    tensors = list(manifest.tensors.values())
    itemsize = np.array([t.itemsize for t in tensors], dtype=np.int64)[plan.tensor]
    numel = np.array([t.numel for t in tensors], dtype=np.int64)[plan.tensor]
    flat = np.array([t.layout == "flat" for t in tensors], dtype=bool)[plan.tensor]
    # a piece as elements of its global tensor: the reader re-finds its one input fragment
    first = np.where(flat, shard_ranges(numel, manifest.world_size, plan.input)[0], 0)
    first = first + (plan.input_offset - plan.input_fragment) // itemsize
    ends = first + plan.nbytes // itemsize
    results = []
    with CheckpointReader(source, manifest) as reader:
        chunks = reader.iter_planned((tensors[t], a, b) for t, a, b in zip(plan.tensor.tolist(), first.tolist(),
                                                                            ends.tolist()))
        for i in (i for i, size in enumerate(plan.output_sizes) if size):
            out = plan.outputs.plan(i)
            if out.hash_table:  # a rank file: the writer adds the hash table and hashes
                def fill(spec, start: int, end: int, write) -> None:
                    _take(chunks, (end - start) * spec.itemsize, write, progress, None)

                results.append(write_rank_file(target, plan.outputs.checkpoint_id, i, plan.outputs.world_size,
                                               [(t.source, t.start, t.end) for t in out.tensors], fill,
                                               durable=False, write_behind=True))
                continue
            layout = [(t.name, t.dtype, t.shape) for t in out.tensors]
            with SafetensorsStreamWriter(target, out.name, layout, {"format": "pt"}, write_behind=True) as writer:
                for t in out.tensors:
                    cast = (t.source.dtype, t.dtype) if t.source.dtype != t.dtype else None
                    _take(chunks, (t.end - t.start) * t.source.itemsize, writer.write, progress, cast)
    return results


def _take(chunks: Iterator[memoryview], nbytes: int, write: Callable, progress: Callable[[int], None] | None,
          cast: tuple[str, str] | None) -> None:
    """Pass the next `nbytes` read on (cast): requests come in the order of the writes."""
    while nbytes:
        chunk = next(chunks)
        nbytes -= len(chunk)
        if cast is not None:
            from zeroshard.toolkit.gather import cast_bytes  # torch: only when a cast is asked

            chunk = cast_bytes(chunk, *cast)
        write(chunk)
        if progress is not None:
            progress(len(chunk))
