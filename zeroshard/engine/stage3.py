"""Stage 3: parameters exist only as shards; each unit is gathered around its forward and backward.

A *unit* is a module whose parameters are gathered together (one all-gather). By default every
module that directly holds parameters is a unit (like DeepSpeed); `stage3_unit_classes` /
`unit_predicate` make chosen modules (e.g. transformer blocks, like FSDP2's `fully_shard`) one
unit covering all parameters below them that no inner unit claims. A parameter held by two
modules (tied weights) belongs to both units; a per-parameter holder count decides when its
storage can really go.

The full parameter keeps its identity (the module's nn.Parameter object) and its shape; only its
storage is allocated and freed (`untyped_storage().resize_`), as FSDP2 does. Tensors autograd
saved during forward (the parameter itself, or views of it like `weight.t()`) share that
storage, so re-gathering before backward brings them back without touching the graph.

All hooks are registered in `Stage3.__init__`:
- forward pre-hook:  gather the unit (or wait for its prefetch), prefetch the next unit;
- forward hook:      free the unit, and hook its outputs' gradients (pre-backward);
- pre-backward:      gather the unit again (first output gradient to arrive), prefetch the next;
- grad_done():       called by the engine's post-accumulate-grad hook; when every trainable
                     parameter of a unit has its gradient, the unit is freed;
- state_dict post-hook: a released parameter in `module.state_dict()` (released_in_state_dict).
Whatever is still gathered when backward ends (frozen units, unused parameters) is freed then.
"Next" comes from the order recorded in the first forward and the first backward through the
engine (backward is recorded rather than assumed to be reversed forward: an enclosing unit's
output gradient arrives before its children's); when a pass deviates from its recorded order,
prefetching stops for the rest of that pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from zeroshard.engine.collectives import Gather, start_gather
from zeroshard.engine.layout import ParamShard
from zeroshard.engine.param_offload import ResidentTier
from zeroshard.errors import ConfigError, EngineUsageError


@dataclass(eq=False)
class Unit:
    index: int
    name: str  # module path ("" for the root module)
    module: nn.Module
    shards: list[ParamShard]
    trainable: int  # shards that receive gradients
    held: bool = False  # this unit holds a reference on its params' storage
    depth: int = 0  # forward calls in progress (a unit may run inside itself or twice)
    pending: int = 0  # trainable params still waiting for their gradient in this backward
    prefetch: Gather | None = field(default=None, repr=False)


def plan_units(module: nn.Module, shards: Sequence[ParamShard], classes: Sequence[str],
               predicate: Callable[[nn.Module], bool] | None) -> list[Unit]:
    """Group parameters into units (see the module docstring); order = module registration order."""
    shard_of = {id(s.param): s for s in shards}
    unknown = set(classes) - {type(m).__name__ for m in module.modules()}
    if unknown:
        raise ConfigError(f"zero_optimization.stage3_unit_classes: no module of class {sorted(unknown)} "
                         f"in {type(module).__name__}")
    roots = [name for name, m in module.named_modules()
             if type(m).__name__ in classes or (predicate is not None and predicate(m))]
    modules = dict(module.named_modules())
    members: dict[str, list[ParamShard]] = {}
    for name, m in modules.items():
        direct = [shard_of[id(p)] for p in m.parameters(recurse=False)]
        if not direct:
            continue
        inside = [r for r in roots if r == "" or name == r or name.startswith(r + ".")]
        owner = max(inside, key=len) if inside else name  # the innermost enclosing unit
        bucket = members.setdefault(owner, [])
        bucket.extend(s for s in direct if s not in bucket)
    units = []
    for name in modules:  # registration order
        if name in members:
            ss = members[name]
            units.append(Unit(len(units), name, modules[name], ss, sum(s.requires_grad for s in ss)))
    return units


def _alloc(p: torch.Tensor) -> int:
    """Give `p` its storage back; return the bytes allocated."""
    storage = p.data.untyped_storage()
    if storage.size() == 0:
        storage.resize_(p.numel() * p.element_size())
        return storage.nbytes()
    return 0


def _free(p: torch.Tensor) -> int:
    """Drop `p`'s storage (shape and identity stay); return the bytes freed."""
    storage = p.data.untyped_storage()
    freed = storage.nbytes()
    storage.resize_(0)
    return freed


class Stage3:
    """Owns the units, their gather/free state and the forward/backward hooks."""

    def __init__(self, module: nn.Module, shards: Sequence[ParamShard], dtype: torch.dtype,
                 world: int, group: Any, prefetch: bool, classes: Sequence[str],
                 predicate: Callable[[nn.Module], bool] | None, device: torch.device | None = None) -> None:
        self.dtype, self.world, self.group, self.prefetch = dtype, world, group, prefetch
        self.device = device  # where full parameters live (masters may be offloaded to the host)
        self.units = plan_units(module, shards, classes, predicate)
        self.units_of: dict[int, list[Unit]] = {}
        for u in self.units:
            for s in u.shards:
                self.units_of.setdefault(s.index, []).append(u)
        self.holders = {s.index: 0 for s in shards}  # units currently holding each param
        # Where the gathers read the partitions from (param_offload.py; set by choose_tier).
        self.tier: ResidentTier = ResidentTier()
        # Unit order of the first forward / backward through the engine.
        self.traces: dict[str, list[int] | None] = {"forward": None, "backward": None}
        self._pass: str | None = None  # the engine pass in progress
        self._recording: list[int] | None = None
        self._cursor: int | None = None
        self._order: list[int] = []
        # Counters for tests and tuning: collectives issued, prefetches used, peak gathered bytes.
        self.stats = {"gathers": 0, "prefetches": 0, "prefetch_hits": 0, "gathered_bytes": 0,
                      "peak_gathered_bytes": 0}
        with torch.no_grad():
            for s in shards:  # the full-size parameter keeps its shape but loses its storage
                s.param.data = torch.empty(s.shape, dtype=dtype, device=device or s.master.device)
                _free(s.param)
        self.handles = []
        for u in self.units:
            self.handles.append(u.module.register_forward_pre_hook(partial(self._pre_forward, u)))
            self.handles.append(u.module.register_forward_hook(partial(self._post_forward, u)))
        for m in module.modules():
            if next(m.parameters(recurse=False), None) is not None:
                # (a partial: torch marks the hook object, which a bound method refuses)
                self.handles.append(m.register_state_dict_post_hook(partial(Stage3._released_entries, self)))

    # What `module.state_dict()` shows of a released parameter (the engine's own reads use
    # keep_vars=True and get the parameter itself): its tensor has the full shape and no storage,
    # so saved it could not be loaded back. "refuse" (the default) raises, naming what to use;
    # "empty" gives an empty tensor, as DeepSpeed shows a partitioned one (the DeepSpeed layer's choice).
    released_in_state_dict = "refuse"

    def _released_entries(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for name, p in module.named_parameters(recurse=False):
            entry = state_dict.get(prefix + name)
            if entry is None or entry is p or p.untyped_storage().size() != 0:
                continue  # not there, keep_vars=True, or gathered right now (inside forward)
            if self.released_in_state_dict == "empty":
                state_dict[prefix + name] = torch.empty(0, dtype=p.dtype, device=p.device)
            else:
                raise EngineUsageError(f"module.state_dict() at stage 3: {prefix + name} is partitioned (full shape, "
                                       "no data; saved, it could not be loaded back): use engine.full_state_dict() "
                                       "on every rank, or save_checkpoint and `zeroshard consolidate`")

    # -- gather / free ---------------------------------------------------------------------

    def acquire(self, unit: Unit) -> None:
        """Make the unit's full parameters available (gathering whatever is not)."""
        if unit.held:
            return
        need = [self.holders[s.index] == 0 and s.numel > 0 for s in unit.shards]
        gather, unit.prefetch = unit.prefetch, None
        if gather is not None:
            self.stats["prefetch_hits"] += 1
        elif any(need):
            gather = self._start(unit, async_op=False)
            self.stats["gathers"] += 1
        if gather is not None:
            with torch.no_grad():
                for s, n in zip(unit.shards, need):
                    if n:
                        self.stats["gathered_bytes"] += _alloc(s.param)
                self.stats["peak_gathered_bytes"] = max(self.stats["peak_gathered_bytes"],
                                                        self.stats["gathered_bytes"])
                # `.data`: the copy must not bump the version counter autograd checks.
                gather.copy_out([s.param.data if n else None for s, n in zip(unit.shards, need)])
        for s in unit.shards:
            self.holders[s.index] += 1
        unit.held = True

    def release(self, unit: Unit) -> None:
        if not unit.held:
            return
        unit.held = False
        for s in unit.shards:
            self.holders[s.index] -= 1
            if self.holders[s.index] == 0:
                self.stats["gathered_bytes"] -= _free(s.param)

    def _prefetch(self, unit: Unit) -> None:
        if not unit.held and unit.prefetch is None:
            unit.prefetch = self._start(unit, async_op=True)
            self.stats["prefetches"] += 1

    def _start(self, unit: Unit, async_op: bool) -> Gather:
        """The all-gather of one unit's full parameters (hpz.py gathers them within the node)."""
        return start_gather(unit.shards, self.dtype, self.world, self.group, async_op=async_op,
                            device=self.device, fill=partial(self.tier.fill, unit.index))

    def _advance(self, unit: Unit) -> None:
        """Record the order (first pass of its kind), or follow it and prefetch the next unit."""
        if self._recording is not None:
            self._recording.append(unit.index)
        if self._cursor is None:
            return
        if self._cursor < len(self._order) and self._order[self._cursor] == unit.index:
            self._cursor += 1
            if self._cursor < len(self._order):
                self._prefetch(self.units[self._order[self._cursor]])
                self._read_ahead(self._cursor + 1)
        else:
            self._cursor = None  # this pass deviates from the recorded order

    def _read_ahead(self, position: int) -> None:
        """Let an NVMe tier start reading the partitions of the units after the next one."""
        if self.tier.depth:
            self.tier.read_ahead(self._order[position: position + self.tier.depth])

    def release_all(self) -> None:
        """Free everything and drop in-flight prefetches (end of backward, or after an error)."""
        for u in self.units:
            if u.prefetch is not None:
                u.prefetch.wait()
                u.prefetch = None
            u.depth = 0
            self.release(u)

    # -- phases (called by the engine) ------------------------------------------------------

    def _begin(self, kind: str) -> None:
        trace = self.traces[kind]
        self._pass = kind
        self._recording = [] if trace is None else None
        self._order = trace or []
        self._cursor = 0 if (trace is not None and self.prefetch) else None
        if self._cursor is not None:
            self._read_ahead(0)

    def _end(self) -> None:
        if self._recording is not None and self._pass is not None:
            self.traces[self._pass] = self._recording
        self._pass, self._recording, self._cursor = None, None, None

    def begin_forward(self) -> None:
        self._begin("forward")

    def end_forward(self) -> None:
        self._end()
        for u in self.units:  # a pass that ended early must not leave a (soon stale) prefetch
            if u.prefetch is not None:
                u.prefetch.wait()
                u.prefetch = None

    def begin_backward(self) -> None:
        for u in self.units:
            u.pending = u.trainable
        self._begin("backward")

    def end_backward(self) -> None:
        self._end()
        self.release_all()

    def grad_done(self, shard: ParamShard) -> None:
        """A trainable parameter's gradient is complete; free units with nothing left to do."""
        for u in self.units_of.get(shard.index, ()):
            if u.pending:
                u.pending -= 1
                if u.pending == 0 and u.depth == 0:
                    self.release(u)

    # -- hooks -------------------------------------------------------------------------------

    def _pre_forward(self, unit: Unit, module: nn.Module, args: Any) -> None:
        self.acquire(unit)
        unit.depth += 1
        if self._pass == "forward":
            self._advance(unit)

    def _post_forward(self, unit: Unit, module: nn.Module, args: Any, output: Any) -> None:
        unit.depth -= 1
        if unit.depth == 0:
            self.release(unit)
        if torch.is_grad_enabled():
            tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, partial(self._pre_backward, unit), mode="any")

    def _pre_backward(self, unit: Unit, grad: Any) -> None:
        self.acquire(unit)
        if self._pass == "backward":
            self._advance(unit)

    def inflight_bytes(self) -> int:
        """Bytes of prefetch buffers whose all-gather has not been consumed yet."""
        return sum(u.prefetch.out.numel() * u.prefetch.out.element_size()
                   for u in self.units if u.prefetch is not None)
