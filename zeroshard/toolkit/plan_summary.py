"""What a copy would read and write, summed without listing its pieces: `--dry-run` at any scale.

A Plan (toolkit/plan.py) holds every piece as a row of eight int64 arrays: a reshard of Llama
405B's training state from 16,384 ranks to 12,288 is about 100 million pieces, gigabytes of arrays
and minutes of numpy, for a dry run that prints a few sums. Those sums follow from the rows a plan
is cut from (an output tensor's range: output, input tensor, elements [start, end)): the partition
rule cuts a row into `count` pieces from consecutive input ranks `first .. first + count - 1`
(partition_arrays.holder_spans), and the bytes read and written are the row's elements. So the
rows are made a block of output ranks at a time and summed: memory O(block + ranks), no piece
materialized. The text is Plan.describe()'s, from one formatter (tests/test_plan_summary.py
compares them on random layouts).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from zeroshard.format.manifest import Manifest
from zeroshard.partition import span_overlaps
from zeroshard.partition_arrays import holder_spans
from zeroshard.storage.safetensors_header import DTYPE_SIZES
from zeroshard.toolkit.plan import file_rows, rank_rows
from zeroshard.toolkit.plan_text import describe_text, shown_outputs
from zeroshard.toolkit.plans import FixedPlans, RankFilePlans, carried_tensors
from zeroshard.toolkit.selection import OutputTensor

ROWS_PER_BLOCK = 1 << 20  # output tensors summed at once (a few arrays of this length: tens of MB)


class _Sums:
    """Rows summed as they come: bytes, pieces, which inputs are read, pieces per output."""

    def __init__(self, manifest: Manifest, outputs: int, casts: Sequence[tuple[str, str] | None],
                 shown: list[int]):
        tensors = list(manifest.tensors.values())
        self.world = manifest.world_size
        self.flat = np.array([t.layout == "flat" for t in tensors], dtype=bool)
        self.holder = np.array([t.owner if t.layout == "local" else 0 for t in tensors], dtype=np.int64)
        self.numel = np.array([t.numel for t in tensors], dtype=np.int64)
        self.in_size = np.array([t.itemsize for t in tensors], dtype=np.int64)
        self.out_size = np.array([DTYPE_SIZES[c[1]] if c else 0 for c in casts], dtype=np.int64)
        self.read = self.written = self.pieces = 0
        self.cover = np.zeros(self.world + 1, dtype=np.int64)  # +1 at a span's first rank, -1 past its last
        self.by_output = np.zeros(outputs, dtype=np.int64)
        self.shown = {i: np.zeros(self.world + 1, dtype=np.int64) for i in shown}

    def add(self, out: np.ndarray, tid: np.ndarray, start: np.ndarray, end: np.ndarray, cast: np.ndarray) -> None:
        """Rows as _plan takes them: flat tensors cut at the input's rank boundaries, the others
        whole from their holder (the rule at a world of one, shifted to the holder)."""
        flat = self.flat[tid]
        first, count = holder_spans(self.numel[tid], np.where(flat, self.world, 1), start, end)
        first = first + np.where(flat, 0, self.holder[tid])
        live = count > 0
        elements = np.where(live, end - start, 0)
        in_size = self.in_size[tid]
        self.pieces += int(count.sum())
        self.read += int((elements * in_size).sum())
        self.written += int((elements * np.where(cast > 0, self.out_size[cast], in_size)).sum())
        self.by_output += np.bincount(out, weights=count, minlength=len(self.by_output)).astype(np.int64)
        self._cover(self.cover, first[live], count[live])
        for i, marks in self.shown.items():
            mine = live & (out == i)
            if mine.any():
                self._cover(marks, first[mine], count[mine])

    def add_flat(self, tensor: int, world_size: int, a: int, b: int) -> None:
        """Rows of output ranks [a, b) of flat input tensor `tensor` at `world_size` ranks
        (describe_reshard), summed by partition.span_overlaps."""
        pieces, elements, (first, end) = span_overlaps(int(self.numel[tensor]), self.world, world_size, a, b)
        self.pieces += pieces
        self.read += elements * int(self.in_size[tensor])
        self.written += elements * int(self.in_size[tensor])
        if end > first:
            self.cover[first] += 1
            self.cover[end] -= 1

    def _cover(self, marks: np.ndarray, first: np.ndarray, count: np.ndarray) -> None:
        size = len(marks)
        marks += np.bincount(first, minlength=size)[:size] - np.bincount(first + count, minlength=size)[:size]

    def inputs(self, marks: np.ndarray) -> int:
        """How many input ranks the spans marked in `marks` cover."""
        return int((np.cumsum(marks[:-1]) > 0).sum())


def describe_reshard(manifest: Manifest, world_size: int, checkpoint_id: str = "0" * 32, limit: int = 10) -> str:
    """make_plan(manifest, world_size).describe(), in O(tensors x runs of alike output ranks):
    the flat tensors of a run of ranks [a, b) are summed in closed form (partition.span_overlaps),
    the rest (tensors stored whole or per rank: a rank each) and the outputs shown from their rows."""
    outputs = RankFilePlans(carried_tensors(manifest, world_size), world_size, checkpoint_id)
    layouts = outputs.layouts
    sizes = [layouts.file_size(r) for r in range(world_size)]
    sums = _Sums(manifest, world_size, [None], [])
    index = {name: i for i, name in enumerate(manifest.tensors)}
    rows: list[tuple[int, int, int]] = []  # (output rank, input tensor, elements) summed row by row
    for i, a in enumerate(layouts.starts):
        b = layouts.starts[i + 1] if i + 1 < len(layouts.starts) else world_size
        run = layouts.run_of(a)
        for k, nbytes in zip(run.tensors, run.nbytes):
            t = layouts.tensors[k]
            if t.layout == "flat":
                sums.add_flat(index[t.name], world_size, a, b)
            else:
                rows += [(r, index[t.name], nbytes // t.itemsize) for r in range(a, b)]
    for r in range(world_size):  # per-rank tensors listed last (RNG states) extend their rank's run
        layout, run = layouts.rank_layout(r), layouts.run_of(r)
        if layout is not run:
            rows += [(r, index[layouts.tensors[k].name], n // layouts.tensors[k].itemsize)
                     for k, n in zip(layout.tensors[len(run.tensors):], layout.nbytes[len(run.tensors):])]
    if rows:
        out, tid, end = np.array(rows, dtype=np.int64).T
        sums.add(out, tid, np.zeros_like(out), end, np.zeros_like(out))  # stored whole: from element 0
    shown = shown_outputs(sizes, limit)
    mine = _Sums(manifest, world_size, [None], shown)  # the outputs listed: from their rows
    out, tid, start, end, _ = rank_rows(manifest, outputs, shown, [0] * world_size)
    mine.add(out, tid, start, end, np.zeros_like(out))
    return describe_text(sums.read, sums.written, sums.inputs(sums.cover), manifest.world_size, sizes, sums.pieces,
                         [None], mine.by_output, lambda i: mine.inputs(mine.shown[i]), outputs.name, limit)


def describe_files(manifest: Manifest, names: Sequence[str], shards: Sequence[Sequence[OutputTensor]],
                   limit: int = 10) -> str:
    """plan_files(manifest, names, shards).describe(), from one row per output tensor."""
    plans, casts, (out, tid, start, end, _, cast) = file_rows(manifest, names, shards)
    sizes = [p.size for p in plans]
    sums = _Sums(manifest, len(plans), casts, shown_outputs(sizes, limit))
    for a in range(0, len(out), ROWS_PER_BLOCK):
        part = slice(a, a + ROWS_PER_BLOCK)
        sums.add(out[part], tid[part], start[part], end[part], cast[part])
    return describe_text(sums.read, sums.written, sums.inputs(sums.cover), manifest.world_size, sizes, sums.pieces,
                         casts, sums.by_output, lambda i: sums.inputs(sums.shown[i]), FixedPlans(plans).name, limit)
