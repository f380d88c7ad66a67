"""What a copy reads and writes, as arrays of pieces: the planner of reshard and consolidate.

A Plan says, for every piece, which input file and byte offset it is read from, which output
file and byte offset it goes to, how many bytes are read and which dtype cast (if any) applies.
It is computed from the manifest alone (pure: no I/O), with the partition rule over all tensors
at once (zeroshard.partition_arrays). Input offsets assume the headers a zeroshard writer puts
in rank files (zeroshard.format.layouts); executors check them against the headers they read
(`input_fragment` says where each piece's fragment was planned to start, so they can rebase).

Outputs are rank files at a world size (reshard) or whole-tensor files (consolidate: one
`.safetensors` file or HF's shards), chosen with include/exclude globs and a dtype cast
(zeroshard.toolkit.selection, which imports no numpy: the commands start without it).
`describe()` prints a plan (`--dry-run`), `split(k)` cuts it by output for k workers or ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence

import numpy as np

from zeroshard.errors import InvalidArgumentError
from zeroshard.format.layouts import Run, layouts_of
from zeroshard.format.manifest import Manifest, TensorEntry
from zeroshard.partition_arrays import holders, shard_ranges
from zeroshard.storage.safetensors_header import DTYPE_SIZES
from zeroshard.toolkit.plan_text import describe_text
from zeroshard.toolkit.plans import (
    PIECE_BUDGET,
    TASK_BYTES,
    FixedPlans,
    OutputPlan,
    RankFilePlans,
    Task,
    carried_tensors,
    plan_output,
)
from zeroshard.toolkit.selection import OutputTensor, model_tensors, output_files

COLUMNS = ("input", "input_offset", "output", "output_offset", "nbytes", "cast", "tensor", "input_fragment")


@dataclass
class Plan:
    """Pieces as parallel int64 arrays (COLUMNS), ordered by output then output offset.

    `tensor` indexes `tensor_names` (the input's tensors), `cast` indexes `casts` (0: none), and
    `input_fragment` is the planned offset of the input fragment a piece is read from."""

    input_names: list[str]
    input_sizes: list[int]
    outputs: FixedPlans | RankFilePlans  # each output file's name, header and tensors (plans.py)
    output_sizes: list[int]
    tensor_names: list[str]
    casts: list[tuple[str, str] | None]
    input: np.ndarray = field(repr=False)
    input_offset: np.ndarray = field(repr=False)
    output: np.ndarray = field(repr=False)
    output_offset: np.ndarray = field(repr=False)
    nbytes: np.ndarray = field(repr=False)
    cast: np.ndarray = field(repr=False)
    tensor: np.ndarray = field(repr=False)
    input_fragment: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def written(self) -> np.ndarray:
        """Bytes each piece writes (a cast changes the element size)."""
        ratio = np.array([1.0] + [DTYPE_SIZES[c[1]] / DTYPE_SIZES[c[0]] for c in self.casts[1:]])
        return (self.nbytes * ratio[self.cast]).astype(np.int64)

    def take(self, mask: np.ndarray) -> Plan:
        """The pieces `mask` (booleans or indices) selects, everything else shared."""
        return replace(self, **{k: getattr(self, k)[mask] for k in COLUMNS})

    def split(self, parts: int, whole_outputs: bool = True) -> list[Plan]:
        """At most `parts` plans about equal in bytes written: of consecutive whole outputs, or
        (`whole_outputs=False`: outputs created up front and filled side by side, such as one big
        consolidated file) of consecutive pieces, at most PIECE_BUDGET each. A part describes the
        outputs it writes in `output_sizes` (whole outputs: those with no piece too)."""
        if parts < 1:
            raise InvalidArgumentError(f"a plan splits into at least 1 part, got {parts}")
        if whole_outputs:
            ends = np.cumsum(np.bincount(self.output, weights=self.written, minlength=len(self.output_sizes)))
        else:
            ends = np.cumsum(self.written)
        goals = ends[-1] * np.arange(1, parts) / parts if len(ends) else []
        budget = [] if whole_outputs else np.arange(0, len(self), PIECE_BUDGET)
        cuts = np.unique(np.r_[0, np.searchsorted(ends, goals, side="right"), budget, len(ends)]).astype(np.int64)
        bounds = np.searchsorted(self.output, cuts) if whole_outputs else cuts  # pieces are ordered by output
        split = []
        for a, b, i0, i1 in zip(bounds[:-1], bounds[1:], cuts[:-1], cuts[1:]):
            part = self.take(slice(a, b))
            mine = range(i0, i1) if whole_outputs else set(part.outputs_used())
            split.append(replace(part, output_sizes=[s if i in mine else 0 for i, s in enumerate(self.output_sizes)]))
        return split

    def outputs_used(self) -> list[int]:
        """The outputs this plan writes pieces into."""
        return np.unique(self.output).tolist()

    def describe(self, limit: int = 10) -> str:
        """What would be read and written, for people (`--dry-run`; at any scale without a
        Plan: toolkit/plan_summary.py prints the same from sums)."""
        pairs = np.unique(self.output * len(self.input_names) + self.input)  # (output, input) pairs
        inputs = np.bincount(pairs // max(len(self.input_names), 1), minlength=len(self.output_sizes))
        return describe_text(int(self.nbytes.sum()), int(self.written.sum()), len(np.unique(self.input)),
                             len(self.input_names), self.output_sizes, len(self), self.casts,
                             np.bincount(self.output, minlength=len(self.output_sizes)), inputs.__getitem__,
                             self.outputs.name, limit)


def split_tasks(plan: Plan, workers: int = 1, whole_outputs: bool = True) -> list[Task]:
    """Tasks of consecutive whole outputs (each then reads a narrow band of inputs), each of about
    PIECE_BUDGET pieces at most and, for small outputs, TASK_BYTES written; a few per worker.
    `whole_outputs=False`: tasks of consecutive pieces of outputs created up front (Plan.split)."""
    written = int(plan.written.sum())
    outputs = sum(1 for s in plan.output_sizes if s)
    parts, _ = task_count(len(plan), written, outputs, workers, whole_outputs)
    return [Task([i for i, size in enumerate(part.output_sizes) if size], plan=part)
            for part in plan.split(parts, whole_outputs)]


def task_count(pieces: int, written: int, outputs: int, workers: int, whole_outputs: bool = True) -> tuple[int, bool]:
    """How many tasks a copy of `pieces` pieces writing `written` bytes into `outputs` files is cut
    into: PIECE_BUDGET pieces at most each and, for small outputs, TASK_BYTES written; a few per
    worker. Also whether the outputs count as small (then the bytes bound a task too)."""
    small = whole_outputs and written <= TASK_BYTES // 4 * max(outputs, 1)
    per_worker = 4 if whole_outputs else 2  # runs of pieces: each task maps every input it reads from
    parts = max(-(-pieces // PIECE_BUDGET), -(-written // TASK_BYTES) if small else 1,
                per_worker * workers * (workers > 1))
    return parts, small


def rank_file_tasks(outputs: RankFilePlans, input_world: int, workers: int = 1) -> list[Task]:
    """Tasks of consecutive whole rank files, each left to plan its own pieces (Task.plan None), so
    that nothing holds the pieces of every output at once: a reshard 16,384 -> 16,000 of 300
    tensors has ~10M pieces (over 600 MB as arrays), a task at most PIECE_BUDGET. Sized as
    split_tasks sizes tasks (task_count), by the pieces each output is expected to need (a fragment spans about
    input_world / world_size + 1 input files) and, for small outputs, the bytes written."""
    layouts = outputs.layouts
    span = math.ceil(input_world / outputs.world_size) + 1  # a cost estimate, not who owns what
    sizes = [layouts.file_size(r) for r in range(outputs.world_size)]
    pieces = [len(layouts.rank_layout(r).tensors) * span for r in range(outputs.world_size)]
    parts, small = task_count(sum(pieces), sum(sizes), sum(1 for s in sizes if s), workers)
    piece_cap, byte_cap = -(-sum(pieces) // parts), (-(-sum(sizes) // parts) if small else None)
    tasks, ranks, held, written = [], [], 0, 0
    for r in range(outputs.world_size):
        if ranks and (held + pieces[r] > piece_cap or (byte_cap is not None and written + sizes[r] > byte_cap)):
            tasks.append(Task(ranks))
            ranks, held, written = [], 0, 0
        ranks.append(r)
        held, written = held + pieces[r], written + sizes[r]
    return tasks + ([Task(ranks)] if ranks else [])


def plan_files(manifest: Manifest, names: Sequence[str], shards: Sequence[Sequence[OutputTensor]]) -> Plan:
    """Whole tensors into files `names` (consolidate): shard i's tensors, back to back, in file i."""
    plans, casts, rows = file_rows(manifest, names, shards)
    return _plan(manifest, FixedPlans(plans), [p.size for p in plans], casts, *rows)


def plan_file_parts(manifest: Manifest, names: Sequence[str],
                    shards: Sequence[Sequence[OutputTensor]]) -> Iterator[Plan]:
    """plan_files in parts, planned one at a time: each of the pieces from one band of consecutive
    input ranks, about PIECE_BUDGET pieces at most (a flat tensor has at most one piece per input
    rank), so that each input file is read by one part only. A consolidate of 300 tensors from
    16,000 ranks has 4.8M pieces: ten parts of 1,600 ranks. Every part describes every output
    (outputs created up front are filled part by part)."""
    plans, casts, rows = file_rows(manifest, names, shards)
    outputs, sizes = FixedPlans(plans), [p.size for p in plans]
    out, tid, start, end, begin, cast = rows
    world, tensors = manifest.world_size, list(manifest.tensors.values())
    flat = np.array([t.layout == "flat" for t in tensors], dtype=bool)[tid]
    expected = int(np.where(flat, world, 1).sum())
    parts = min(world, max(1, -(-expected // PIECE_BUDGET)))
    if parts == 1:
        yield _plan(manifest, outputs, sizes, casts, *rows)
        return
    numel = np.array([t.numel for t in tensors], dtype=np.int64)[tid]
    holder = np.array([t.owner if t.layout == "local" else 0 for t in tensors], dtype=np.int64)[tid]
    in_size = np.array([t.itemsize for t in tensors], dtype=np.int64)[tid]
    out_size = np.where(cast > 0, np.array([DTYPE_SIZES[c[1]] if c else 0 for c in casts], dtype=np.int64)[cast],
                        in_size)
    bands = [world * k // parts for k in range(parts + 1)]  # each part's input ranks [first, stop)
    for first, stop in zip(bands[:-1], bands[1:]):
        lo = np.maximum(start, shard_ranges(numel, world, first)[0])
        hi = np.minimum(end, shard_ranges(numel, world, stop)[0] if stop < world else numel)
        keep = np.where(flat, lo < hi, (holder >= first) & (holder < stop))
        lo, hi = np.where(flat, lo, start), np.where(flat, hi, end)
        yield _plan(manifest, outputs, sizes, casts, out[keep], tid[keep], lo[keep], hi[keep],
                    (begin + (lo - start) * out_size)[keep], cast[keep])


def file_rows(manifest: Manifest, names: Sequence[str], shards: Sequence[Sequence[OutputTensor]],
              ) -> tuple[list[OutputPlan], list[tuple[str, str] | None], tuple[np.ndarray, ...]]:
    """Each file's plan, the casts (0: none) and its tensors as rows (output, input tensor index,
    elements [start, end), output byte offset, cast)."""
    plans = [plan_output(name, [(t.name, t.source, 0, t.source.numel, t.dtype, t.source.shape) for t in shard],
                         {"format": "pt"}, hash_table=False) for name, shard in zip(names, shards)]
    index = {name: i for i, name in enumerate(manifest.tensors)}
    casts: list[tuple[str, str] | None] = [None]
    rows = []
    for i, p in enumerate(plans):
        for t in p.tensors:
            cast = (t.source.dtype, t.dtype) if t.source.dtype != t.dtype else None
            if cast not in casts:
                casts.append(cast)
            rows.append((i, index[t.source.name], t.start, t.end, t.begin, casts.index(cast)))
    return plans, casts, tuple(np.array(rows, dtype=np.int64).reshape(-1, 6).T)


def plan_rank_files(manifest: Manifest, tensors: Sequence[TensorEntry], world_size: int, checkpoint_id: str) -> Plan:
    """`tensors` of `manifest` as the rank files of a checkpoint at `world_size` (reshard)."""
    return plan_ranks(manifest, RankFilePlans(list(tensors), world_size, checkpoint_id), range(world_size))


def plan_ranks(manifest: Manifest, outputs: RankFilePlans, ranks: Sequence[int]) -> Plan:
    """The pieces of whole rank files `ranks` (ascending), from the runs of alike ranks of their
    layouts: array operations per run, not a Python loop per fragment."""
    sizes = [0] * outputs.count
    out, tid, start, end, begin = rank_rows(manifest, outputs, ranks, sizes)
    return _plan(manifest, outputs, sizes, [None], out, tid, start, end, begin, np.zeros_like(out))


def rank_rows(manifest: Manifest, outputs: RankFilePlans, ranks: Sequence[int],
              sizes: list[int]) -> tuple[np.ndarray, ...]:
    """The output tensors of rank files `ranks` as rows (output, input tensor index, elements
    [start, end), output byte offset); each rank's file size into `sizes[rank]`."""
    out, tid, start, end, begin = output_rows(outputs, ranks, sizes)
    index = {name: i for i, name in enumerate(manifest.tensors)}
    to_input = np.array([index[t.name] for t in outputs.layouts.tensors], dtype=np.int64)
    return out, to_input[tid], start, end, begin


def output_rows(outputs: RankFilePlans, ranks: Sequence[int], sizes: list[int]) -> tuple[np.ndarray, ...]:
    """rank_rows with each row's tensor as an index into `outputs.layouts.tensors` (no input
    checkpoint needed: `shard` fills them from a model file)."""
    layouts, ranks = outputs.layouts, list(ranks)
    runs = [layouts.rank_layout(r) for r in ranks]
    heads = [layouts.header_length(r) for r in ranks]
    for r, run, h in zip(ranks, runs, heads):
        sizes[r] = h + run.data_bytes
    cuts = [k for k in range(len(ranks)) if k == 0 or runs[k] is not runs[k - 1]] + [len(ranks)]
    parts = [(np.repeat(ranks[a:b], len(run[0])), np.tile(run[0], b - a),
              np.tile(run[1], b - a) + np.repeat(heads[a:b], len(run[0])), np.tile(run[2], b - a))
             for a, b in zip(cuts[:-1], cuts[1:]) for run in [run_arrays(runs[a])]]
    empty = [np.zeros(0, dtype=np.int64)] * 4
    out, tid, begin, nbytes = (np.concatenate(c).astype(np.int64) for c in zip(*parts)) if parts else empty
    tensors = layouts.tensors
    numel, itemsize = (np.array([getattr(t, k) for t in tensors], dtype=np.int64)[tid] for k in ("numel", "itemsize"))
    start = np.where(np.array([t.layout == "flat" for t in tensors], dtype=bool)[tid],
                     shard_ranges(numel, outputs.world_size, out)[0], 0)
    return out, tid, start, start + nbytes // itemsize, begin


def run_arrays(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A run's (tensor indices, begins, sizes) as arrays, made once."""
    if run.arrays is None:
        run.arrays = tuple(np.asarray(column, dtype=np.int64) for column in (run.tensors, run.begin, run.nbytes))
    return run.arrays


def make_plan(manifest: Manifest, output: int | str, *, dtype: str | None = None, include: list[str] | None = None,
              exclude: list[str] | None = None, strip_prefix: list[str] | None = None,
              max_shard_size: str | None = None, checkpoint_id: str = "0" * 32) -> Plan:
    """The plan of a reshard (`output`: a world size; 'local' tensors kept only at the same one)
    or of a consolidate (`output`: a file name ending .safetensors, or anything else: HF shards)."""
    if isinstance(output, int):
        return plan_rank_files(manifest, carried_tensors(manifest, output), output, checkpoint_id)
    names, shards, _ = output_files(output, model_tensors(output, manifest, dtype, include, exclude, strip_prefix),
                                    max_shard_size)
    return plan_files(manifest, names, shards)


def _plan(manifest: Manifest, outputs: FixedPlans | RankFilePlans, sizes: list[int],
          casts: list[tuple[str, str] | None], out: np.ndarray, tid: np.ndarray, start: np.ndarray,
          end: np.ndarray, begin: np.ndarray, cast: np.ndarray) -> Plan:
    """Cut output tensors (rows: output, input tensor index, elements [start, end), output byte
    offset, cast) at the input's rank boundaries: the pieces."""
    tensors = list(manifest.tensors.values())
    world = manifest.world_size
    flat = np.array([t.layout == "flat" for t in tensors], dtype=bool)
    holder = np.array([t.owner if t.layout == "local" else 0 for t in tensors], dtype=np.int64)
    numel = np.array([t.numel for t in tensors], dtype=np.int64)
    # flat tensors are cut at the input's rank boundaries; the others come whole from their
    # holder (the rule at a world of one, shifted to the holder)
    found = holders(numel[tid], np.where(flat[tid], world, 1), start, end)
    row, t = found.row, tid[found.row]
    rank = found.rank + np.where(flat[t], 0, holder[t])
    fragment = _fragment_offsets(manifest, rank, t)
    in_size = np.array([e.itemsize for e in tensors], dtype=np.int64)[t]
    out_size = np.array([DTYPE_SIZES[c[1]] if c else 0 for c in casts], dtype=np.int64)[cast[row]]
    out_size = np.where(cast[row] > 0, out_size, in_size)
    return Plan([f.name for f in manifest.files], [f.size for f in manifest.files], outputs, sizes,
                [t.name for t in tensors], casts, input=rank,
                input_offset=fragment + (found.lo - found.rank_start) * in_size, output=out[row],
                output_offset=begin[row] + (found.lo - start[row]) * out_size, nbytes=(found.hi - found.lo) * in_size,
                cast=cast[row], tensor=t, input_fragment=fragment)


def _fragment_offsets(manifest: Manifest, rank: np.ndarray, tensor: np.ndarray) -> np.ndarray:
    """Where tensor[i]'s fragment starts in input file rank[i], as a zeroshard writer lays it out."""
    layouts = layouts_of(manifest)  # shared with the executor's reader
    needed = np.flatnonzero(np.bincount(rank, minlength=manifest.world_size))  # sorted, as np.unique, in O(n)
    data_at = np.zeros(manifest.world_size, dtype=np.int64)
    data_at[needed] = [layouts.header_length(q) for q in needed.tolist()]
    runs = np.searchsorted(np.asarray(layouts.starts, dtype=np.int64), needed, side="right") - 1
    table = np.full((len(layouts.starts), len(layouts.tensors)), -1, dtype=np.int64)  # run, tensor -> begin
    for r in np.unique(runs).tolist():
        run = layouts.run_of(layouts.starts[r])  # made on first use: only the runs needed
        table[r, run.tensors] = run.begin
    run_of = np.zeros(manifest.world_size, dtype=np.int64)
    run_of[needed] = runs
    begins = table[run_of[rank], tensor]
    for i in np.flatnonzero(begins < 0).tolist():  # per-rank tensors: in their rank's own layout
        layout = layouts.rank_layout(int(rank[i]))
        begins[i] = layout.begin[layout.tensors.index(int(tensor[i]))]
    return data_at[rank] + begins
