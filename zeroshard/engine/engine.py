"""ZeroEngine: forward, backward and step for ZeRO stages 0-3, and `initialize`.

What each rank holds (Ψ = parameter count, N = world size, chunks padded per zeroshard.partition):

  stage 0  full module params (compute dtype), full grads, full fp32 master + optimizer state;
           gradients are all-reduced (plain data parallelism through the same code path).
  stage 1  full module params and grads; fp32 master and optimizer state for its chunks only;
           gradients are reduce-scattered at the accumulation boundary (none before it), the
           updated chunks all-gathered back into the module params.
  stage 2  as stage 1, but every backward reduce-scatters gradients into the fp32 gradient shard
           as they become ready (bucketed, asynchronous) and frees `.grad` at once.
  stage 3  as stage 2, and the module params have no storage outside their unit's forward and
           backward (see stage3.py); the fp32 master chunks are the only persistent copy.

In fp32 at stage 0 the master *is* the module parameter (no second copy).

State for checkpoints: `checkpoint_state()` returns an EngineState (contract.py) of live
references, `restore()` applies one; the engine knows nothing of files (zeroshard.checkpointing
maps that state to the format). `named_shards()` / `load_shards()` are the per-parameter view of
the same state. The field-by-field description is in the package docstring
(zeroshard/engine/__init__.py) and docs/ENGINE.md.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.engine import comm_ledger, memory, state
from zeroshard.engine.agreement import agree_on_build
from zeroshard.engine.collectives import all_reduce, broadcast, ensure_process_group
from zeroshard.engine.config import ZeroConfig
from zeroshard.engine.contract import EngineState
from zeroshard.engine.grad_strategy import GradSharding, grad_sharding_for
from zeroshard.engine.layout import ParamShard, ShardInfo, build_shards
from zeroshard.engine.meta_init import MetaInit, check_initializable, has_meta
from zeroshard.engine.offload import master_device
from zeroshard.engine.optim import build_optimizer, check_user_optimizer
from zeroshard.engine.param_gather import ParamRefresh
from zeroshard.engine.param_offload import ResidentTier
from zeroshard.engine.param_offload import check_path as check_offload_path
from zeroshard.engine.param_strategy import ParamResidency, param_residency_for
from zeroshard.engine.precision import LossScaler, cast_buffers, cast_floating
from zeroshard.engine.stage3 import Stage3
from zeroshard.errors import ArgumentTypeError, EngineUsageError, InvalidArgumentError
from zeroshard.peers import peer_loss_translated
from zeroshard.torch_version import require_supported_torch


def _weak_grad_hook(engine: "ZeroEngine", shard: ParamShard) -> Callable[[torch.Tensor], None]:
    """The post-accumulate-grad hook of `shard`'s parameter, holding the engine weakly: a tensor
    keeps its hooks where the garbage collector cannot see them, so a strong reference would
    make every engine (its model, optimizer state and process groups, whose gloo threads poll)
    live as long as the parameter, even after the last user reference is gone."""
    ref = weakref.WeakMethod(engine._on_grad)

    def hook(param: torch.Tensor) -> None:
        on_grad = ref()
        if on_grad is not None:
            on_grad(shard, param)
    return hook


def initialize(model: nn.Module,
               optimizer: torch.optim.Optimizer | Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
               config: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None = None, *,
               init_fn: Callable[[nn.Module], None] | None = None,
               engine_class: type["ZeroEngine"] | None = None) -> "ZeroEngine":
    """Wrap `model` and `optimizer` in a ZeroEngine (creating the process group if needed).

    `zeroshard.initialize` is this with engine_class=zeroshard.training.CheckpointingEngine,
    which adds save_checkpoint/load_checkpoint.

    optimizer=None builds an engine for inference (a reference or reward model beside the one
    being trained): forward only, at stage 0 (replicated) or 3 (partitioned); its partitions hold
    the compute dtype, not fp32 masters, so stage 3 keeps 2Ψ/N bytes per rank in bf16.

    Every rank must call this with the same model structure and config. Input errors found on
    any rank are raised on every rank (nobody is left waiting in a collective).

    A model built on the meta device (`torch.device("meta")` or `zeroshard.zero_init()`) is
    materialized here one module at a time (stage 3: never whole), each module initialized by
    `init_fn(module)` if given, else by its `reset_parameters()`; see meta_init.py.
    """
    require_supported_torch()  # every rank has the same torch: all raise, none waits
    device = ensure_process_group()
    cfg, error = None, None
    try:
        cfg = ZeroConfig.coerce(config)
        _check_model(model)
        if optimizer is None:
            cfg.check_for_inference()
        elif isinstance(optimizer, torch.optim.Optimizer):
            check_user_optimizer(optimizer, model)
        elif not callable(optimizer):
            raise ArgumentTypeError(f"optimizer must be a torch.optim.Optimizer or a factory, "
                            f"not {type(optimizer).__name__}")
        cfg.resolve_accumulation(dist.get_world_size())
        if init_fn is not None and not callable(init_fn):
            raise ArgumentTypeError(f"init_fn must be callable, not {type(init_fn).__name__}")
        check_initializable(model, init_fn)
        check_offload_path(cfg.zero_optimization.offload_param)
    except (ValueError, TypeError) as e:
        error = e
    # Before any collective whose sizes depend on the model: all ranks built the same one, alike.
    agree_on_build(error, model, cfg)
    return (engine_class or ZeroEngine)(model, optimizer, cfg, device, init_fn=init_fn)


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise InvalidArgumentError(f"{type(model).__name__} has no parameters: there is nothing to train or shard")
    bad = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if bad:
        raise InvalidArgumentError(f"only floating-point parameters can be trained/sharded; not: {bad}")
    wide = [n for n, p in model.named_parameters() if p.dtype == torch.float64]
    if wide:  # the masters would round them, frozen or not, and training would not be float64's
        raise InvalidArgumentError(f"float64 parameters ({', '.join(wide[:5])}{', ...' if len(wide) > 5 else ''}): "
                                   "the engine keeps fp32 master weights, which would round them; cast the model "
                                   "with model.float(), or hold a constant as a buffer")


class ZeroEngine:
    """Data-parallel training with ZeRO partitioning. Build it with `zeroshard.initialize`.

    Training: `engine(*inputs)` (forward), `backward(loss)`, `step()`. State: `checkpoint_state()`,
    `restore()`, `named_shards()`, `load_shards()`, `full_state_dict()`, `load_full_state_dict()`,
    `memory_report()`. Checkpoint files: zeroshard.Checkpointer, or the conveniences of the
    engine `zeroshard.initialize` returns (zeroshard/training.py).

    Public attributes: module, optimizer (the real torch optimizer over the fp32 shards: attach LR
    schedulers to it), config, rank, world_size, stage, device, gradient_accumulation_steps,
    global_steps (optimizer steps taken), micro_steps (step() calls), skipped_steps (fp16
    overflows), last_grad_norm (pre-clipping global norm, when clipping or fp16 computed it),
    shard_world_size / shard_rank (the partition's world and rank: 1 and 0 at stage 0),
    inference (True when built without an optimizer: `optimizer` is then None, and backward and
    step refuse), cast_inputs (floating forward inputs to the compute dtype; default True).
    """

    def __init__(self, module: nn.Module, optimizer: Any, config: ZeroConfig, device: torch.device,
                 init_fn: Callable[[nn.Module], None] | None = None) -> None:
        self.config = config
        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.stage = config.stage
        self.gradient_accumulation_steps = config.resolve_accumulation(self.world_size)
        self.compute_dtype = config.compute_dtype
        # No optimizer: an engine for forward only. Its "masters" are the parameters' partitions
        # in the compute dtype (nothing will be updated, so fp32 copies would only cost memory).
        self.inference = optimizer is None
        # Floating inputs to the compute dtype, as FSDP2's cast_forward_inputs; the DeepSpeed layer
        # turns it off, as DeepSpeed casts none (a float target would be rounded to bf16).
        self.cast_inputs = True
        # The one place the stage is read: it picks a strategy per concern (grad_strategy.py,
        # param_strategy.py); everything below delegates to them instead of branching.
        grad_cls: type[GradSharding] = grad_sharding_for(self.stage)
        z = config.zero_optimization
        param_cls: type[ParamResidency] = param_residency_for(self.stage, z.zero_hpz_partition_size,
                                                              self.world_size)
        partitioned = param_cls.partitioned
        self.shard_world_size = self.world_size if grad_cls.partitioned else 1
        self.shard_rank = self.rank if grad_cls.partitioned else 0
        self.global_steps = self.micro_steps = self.skipped_steps = 0
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._pending = 0  # backwards since the last applied step (read under the override)
        # micro_steps when the current count of accumulation windows began: 0, or the step count a
        # checkpoint restored. A load starts a new window (no accumulated gradient is ever saved), and
        # the windows of a run resumed with another gradient_accumulation_steps (as at another world
        # size, to keep the global batch) must not be cut by the old run's count.
        self._window_origin = 0
        self.last_grad_norm: float | None = None
        self._backward_done = self._in_backward = self._reducing = False
        # Ranks per node, so the ledger can tell which collectives cross nodes (comm_ledger.py);
        # without torchrun's LOCAL_WORLD_SIZE, hpZ's partition size, else one node (0).
        hpz = z.zero_hpz_partition_size
        comm_ledger.LEDGER.set_node_size(int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (hpz if hpz > 1 else 0))

        self.group = dist.group.WORLD
        # Meta-built model: real tensors replace the meta ones; values come from materialize(),
        # here at stages 0-2 (whole model), after sharding at stage 3 (module by module).
        meta = MetaInit(module, device, storage=not partitioned) if has_meta(module) else None
        if meta is not None:
            meta.remap_optimizer(optimizer)
            if not partitioned:
                meta.materialize(init_fn, lambda p, value: p.data.copy_(value), device, self.group)
        self.module = module.to(device)
        # Separate groups so gradient reductions and parameter gathers launched from hooks
        # never need a common order with each other, only among themselves.
        self._rs_group = dist.new_group()
        self._ag_group = dist.new_group()
        self._broadcast_from_rank0(params=meta is None or not partitioned)

        # offload_optimizer: masters (so gradient shards and optimizer state) in host memory.
        self.master_device, pin = (device, False) if self.inference else master_device(config, device)
        self.shards: list[ParamShard] = build_shards(module, self.shard_world_size, self.shard_rank,
                                                     self.master_device, pin=pin,
                                                     pending=meta.pending if meta is not None else (),
                                                     dtype=self.compute_dtype if self.inference else torch.float32)
        self._trainable = [] if self.inference else [s for s in self.shards if s.requires_grad]
        self._shard_by_param = {id(s.param): s for s in self.shards}
        self._buffer_dtypes = cast_buffers(module, config.buffer_dtype)
        self._params = param_cls(module, self.shards, self.compute_dtype, self.world_size, self._ag_group,
                                 config, device)
        self._stage3, self._refresh = self._params.scheduler, self._params.refresh  # diagnostics
        if meta is not None and partitioned:
            meta.materialize(init_fn, self._set_master, device, self.group)
            self._broadcast_from_rank0(params=False)
        # offload_param (stage 3): where the partitions the gathers read live (param_offload.py).
        self.param_tier: ResidentTier = self._params.tier(z.offload_param, self.rank)
        self.optimizer = None if self.inference else build_optimizer(optimizer, self.shards)
        self.scaler = LossScaler(config.fp16)
        self._grads = grad_cls(self._trainable, self.world_size, self._rs_group, config.reduce_dtype,
                               int(z.reduce_bucket_size), z.overlap_comm, device)
        self.reducer = self._grads.reducer
        # (an inference engine's too: a gradient reaching one is refused, not kept whole at stage 3)
        self._hooks = [s.param.register_post_accumulate_grad_hook(_weak_grad_hook(self, s))
                       for s in self.shards if s.requires_grad]
        self.reset_comm_report()

    # -- set-up helpers ------------------------------------------------------------------------

    def _broadcast_from_rank0(self, params: bool = True) -> None:
        """Start every rank from rank 0's weights and buffers (as DDP does)."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for t in (list(self.module.parameters()) if params else []) + list(self.module.buffers()):
                broadcast(t.data, 0, self.group)

    def _set_master(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """Meta init at stage 3: keep this rank's range of a freshly initialized full parameter."""
        s = self._shard_by_param[id(param)]
        s.master[: s.owned].copy_(value.reshape(-1)[s.start: s.end])

    # -- training ----------------------------------------------------------------------------

    @peer_loss_translated("the training step")  # a lost node: PeerLostError naming it
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module (floating inputs cast to the compute dtype unless `cast_inputs` is off)."""
        if self.cast_inputs and self.compute_dtype != torch.float32:
            args, kwargs = cast_floating((args, kwargs), self.compute_dtype)
        return self._params.forward(lambda: self.module(*args, **kwargs))

    __call__ = forward

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next step() will update the weights."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps - self._window_origin + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the next backward and step() end an accumulation window, instead of the
        engine counting gradient_accumulation_steps step() calls: DeepSpeed's override, which
        Accelerate uses (it calls step() once per window, after the last backward). None counts
        again. Every rank must say the same; the loss is still divided by gradient_accumulation_steps."""
        self._boundary = None if is_boundary is None else bool(is_boundary)

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches whose gradients no step has applied yet: counted in step() calls, or
        under set_gradient_accumulation_boundary in backwards (step() may come once per window)."""
        if self._boundary is None:
            return (self.micro_steps - self._window_origin) % self.gradient_accumulation_steps
        return self._pending

    @peer_loss_translated("the training step")  # a lost node: PeerLostError naming it
    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backpropagate `loss / gradient_accumulation_steps` (times the fp16 loss scale);
        scale_wrt_gas=False: `loss` as given, already divided by the caller (as DeepSpeed's flag,
        which the Hugging Face Trainer passes)."""
        self._refuse_in_inference("backward")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ArgumentTypeError("engine.backward expects the scalar loss tensor")
        if not loss.requires_grad:
            raise EngineUsageError("the loss does not require grad (was forward run under torch.no_grad?)")
        self._reducing = self._grads.reducing(self.is_gradient_accumulation_boundary())
        if self._reducing:
            self.reducer.begin()
        self._params.begin_backward()
        factor = self.scaler.scale / (self.gradient_accumulation_steps if scale_wrt_gas else 1)
        self._in_backward = True
        try:
            (loss.float() * factor if factor != 1.0 else loss).backward()
        except BaseException as e:
            self._params.backward_failed(e)  # may raise a clearer error in its place
            raise
        finally:
            self._in_backward = False
        if self._reducing:
            self.reducer.finish()
        self._params.end_backward()
        self._backward_done = True
        self._pending += 1

    def _on_grad(self, shard: ParamShard, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: hand a finished gradient to the reducer and free it."""
        if self.inference:
            param.grad = None
            raise EngineUsageError("a gradient reached a parameter of an engine built without an optimizer (for "
                                   "inference): run its forward under torch.no_grad(), or detach its outputs")
        if not self._in_backward:
            raise EngineUsageError("a gradient reached a zeroshard parameter outside engine.backward(): "
                               "call engine.backward(loss), not loss.backward()")
        if not self._reducing:
            return  # stages 0/1 between boundaries: keep accumulating in .grad
        self.reducer.grad_ready(shard, param.grad)
        param.grad = None
        self._params.grad_done(shard)

    @peer_loss_translated("the training step")  # a lost node: PeerLostError naming it
    def step(self) -> None:
        """Count a micro-step; at an accumulation boundary, update the weights and zero grads."""
        self._refuse_in_inference("step")
        if not self._backward_done:
            raise EngineUsageError("engine.step() called without engine.backward(loss) since the last step()")
        if self.is_gradient_accumulation_boundary():
            self._optimizer_step()
            self._pending = 0
        self.micro_steps += 1
        self._backward_done = False

    def _refuse_in_inference(self, what: str) -> None:
        if self.inference:
            raise EngineUsageError(f"engine.{what}() on an engine built without an optimizer (for inference: "
                                   "forward only); pass an optimizer to initialize to train this model")

    def _optimizer_step(self) -> None:
        # Every trainable master has a gradient after a boundary backward (zeros if unused).
        grads = [s.master.grad for s in self._trainable if s.master.grad is not None]
        scale = self.scaler.scale
        clip = self.config.gradient_clipping
        coef = 1.0 / scale
        if clip > 0 or self.scaler.enabled:
            # One number serves both: the global norm, and (non-finite) the fp16 overflow flag.
            # per-tensor norms in one call (as clip_grad_norm_), not three kernels per tensor
            sq = (torch.stack(torch._foreach_norm(grads)).pow(2).sum() if grads
                  else torch.zeros((), dtype=torch.float32, device=self.master_device))
            if self.shard_world_size > 1:
                sq = sq.to(self.device)  # offloaded grads: the norm is summed on the host, reduced here
                all_reduce(sq, self.group)
            total = sq.item()
            norm = math.sqrt(total) if math.isfinite(total) else math.inf
            if self.scaler.enabled and not math.isfinite(norm):
                self._zero_grads()
                self.scaler.update(overflow=True)
                self.skipped_steps += 1
                return
            self.last_grad_norm = norm / scale
            if clip > 0:
                coef *= min(1.0, clip / (self.last_grad_norm + 1e-6))  # as clip_grad_norm_
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self._zero_grads()
        self._refresh_params()
        self.global_steps += 1
        self.scaler.update(overflow=False)

    def _zero_grads(self) -> None:
        for s in self.shards:
            s.master.grad = None
            s.param.grad = None

    def _refresh_params(self) -> None:
        """Copy updated masters into the module params (all-gathered at stages 1 and 2)."""
        self._params.after_step(self._trainable)
        self.param_tier.update()  # offload_param: the partitions follow the masters

    def wait_params(self) -> None:
        """Stages 1-2: finish the parameter all-gathers still in flight after step(), so that
        `engine.module`'s parameters hold the updated weights. The engine's own forward and
        state methods call it; call it before reading the module's parameters yourself."""
        self._params.wait()

    # -- small conveniences --------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def param_refresh(self) -> ParamRefresh | None:
        """Stages 1-2: the asynchronous parameter all-gathers after a step (for diagnostics)."""
        return self._refresh

    @property
    def param_gather_group(self) -> Any:
        """The process group of parameter all-gathers (separate from gradient reductions)."""
        return self._ag_group

    @property
    def buffer_dtypes(self) -> dict[str, torch.dtype]:
        """Buffer name -> its dtype before the engine cast it to the compute dtype."""
        return self._buffer_dtypes

    def shard_of(self, param: torch.Tensor) -> ParamShard | None:
        """The shard of a module parameter (None for a tensor that is not one)."""
        return self._shard_by_param.get(id(param))

    @property
    def stage3_scheduler(self) -> Stage3 | None:
        """Stage 3: the units and their gather/free state (for diagnostics)."""
        return self._stage3

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    def comm_report(self) -> dict[str, dict[str, float]]:
        """What this process's collectives moved per optimizer step since initialize (or the last
        reset_comm_report()), by kind (all_gather, reduce_scatter, all_reduce, broadcast) and in
        `total`: calls, payload bytes/elements, and bytes/elements this rank sent by the ring
        formulas (comm_ledger.py). Stages 0-2 send 2Ψ(N-1)/N elements per step, stage 3 3Ψ(N-1)/N."""
        return comm_ledger.report(self._comm_since, self.global_steps - self._comm_steps_at, self.world_size)

    def reset_comm_report(self) -> None:
        self._comm_since, self._comm_steps_at = comm_ledger.LEDGER.snapshot(), self.global_steps

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now: params, grads, optimizer (incl. fp32 master), buffers, comm,
        total; plus `master` (part of optimizer). See memory.py."""
        return memory.report(self)

    # -- state for checkpoints (see state.py) ------------------------------------------------------

    def named_shards(self) -> Iterator[tuple[str, ShardInfo]]:
        """(name, ShardInfo) per unique parameter, in named_parameters() order (tied: first name)."""
        return state.named_shards(self)

    def load_shards(self, states: Mapping[str, Mapping[str, Any]], strict: bool = True, adopt: bool = False) -> None:
        """Assign master fragments / optimizer state per parameter name (collective at stages 1-2).
        adopt=True: padded per-element state tensors become the optimizer state without a copy."""
        state.load_shards(self, states, strict=strict, adopt=adopt)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights plus buffers on rank 0 (CPU tensors, model.state_dict() names); {} elsewhere."""
        return state.full_state_dict(self)

    def full_state_items(self) -> Iterator[tuple[str, Any]]:
        """full_state_dict() one entry at a time, (name, tensor on rank 0 / None elsewhere), one
        parameter in memory at a time. Collective: every rank iterates to the end."""
        return state.full_state_items(self)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load full (unsharded) weights, given on every rank; each rank keeps its range."""
        state.load_full_state_dict(self, state_dict, strict=strict)

    def checkpoint_state(self) -> EngineState:
        """Everything a checkpoint holds of this rank, as live references (see contract.py)."""
        return state.checkpoint_state(self)

    def restore(self, engine_state: EngineState, *, strict: bool = True, adopt: bool = False) -> None:
        """Apply an EngineState (collective at stages 1-2: every rank calls it). strict=False
        accepts a subset of the parameters; adopt=True lets padded per-element optimizer state
        become the engine's without a copy (the caller gives it up)."""
        state.restore(self, engine_state, strict=strict, adopt=adopt)
        if engine_state.counters is not None:  # a resumed run: its next step() call begins a window
            self._zero_grads()
            self._window_origin, self._pending = self.micro_steps, 0

    def __repr__(self) -> str:
        return (f"ZeroEngine(stage={self.stage}, rank={self.rank}/{self.world_size}, "
                f"dtype={self.compute_dtype}, optimizer={type(self.optimizer).__name__ if self.optimizer else None}, "
                f"params={len(self.shards)})")
