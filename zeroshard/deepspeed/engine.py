"""DeepSpeedEngine: DeepSpeed's engine surface over a native ZeroEngine.

Everything is delegated; what differs from the native API is DeepSpeed's spelling: batch
sizes and flags are methods, the LR scheduler is stepped inside step() after every applied
optimizer step, save_checkpoint returns True, load_checkpoint returns (path, client_state).
The native engine is `.engine`; anything not defined here is looked up on it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from zeroshard.errors import CheckpointError


class DeepSpeedEngine:
    def __init__(self, engine: Any, lr_scheduler: Any, split: Any) -> None:
        self.engine = engine
        self.lr_scheduler = lr_scheduler
        self._split = split
        self.config = split.raw
        self.local_rank = int(os.environ.get("LOCAL_RANK", engine.rank))
        self.global_rank = engine.rank
        self.world_size = self.dp_world_size = engine.world_size
        self.device = engine.device
        self.module = engine.module
        self.optimizer = engine.optimizer

    # -- training ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        if retain_graph or not scale_wrt_gas:
            raise NotImplementedError("backward(retain_graph=True / scale_wrt_gas=False) is not supported")
        self.engine.backward(loss)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """A micro-step; at the boundary the optimizer step, then the scheduler unless fp16 overflowed."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self.engine.step()
        if boundary:
            self._step_applied = self.engine.skipped_steps == skipped
        if boundary and self._step_applied and self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def was_step_applied(self) -> bool:
        """Whether the last boundary step updated the weights (False after an fp16 overflow)."""
        return getattr(self, "_step_applied", False)

    def zero_grad(self) -> None:
        """Gradients are already released after each step()."""

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        self.engine.train(mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    # -- DeepSpeed's getters -------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_steps * self.train_batch_size()

    def train_batch_size(self) -> int:
        return self._split.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._split.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.engine.gradient_accumulation_steps

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def zero_optimization_stage(self) -> int:
        return self.engine.stage

    def zero_optimization(self) -> bool:
        return self.engine.stage > 0

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    bf16_enabled = bfloat16_enabled

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.engine.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The pre-clipping global norm of the last step (None when neither clipping nor fp16 computed it)."""
        return self.engine.last_grad_norm

    def get_loss_scale(self) -> float:
        return self.engine.loss_scale

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save to save_dir/tag (tag: global_step{N}, as DeepSpeed); client_state must be JSON data.
        Between accumulation boundaries it saves without the accumulated gradients, as DeepSpeed does
        (zeroshard's own save_checkpoint refuses there)."""
        if not save_latest or exclude_frozen_parameters:
            raise NotImplementedError("save_latest=False / exclude_frozen_parameters=True are not supported")
        self.engine.save_checkpoint(save_dir, tag or f"global_step{self.engine.global_steps}",
                                    client_state=dict(client_state or {}), lr_scheduler=self.lr_scheduler,
                                    allow_mid_accumulation=True)
        return True

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[str | None, Any]:
        """Load load_dir/tag (or what load_dir/latest names); (None, None) when there is no
        `latest`, as DeepSpeed. Returns (checkpoint path, client_state)."""
        if custom_load_fn is not None:
            raise NotImplementedError("custom_load_fn is not supported")
        path = load_dir if tag is None else os.path.join(load_dir, str(tag))
        if tag is None and not _looks_committed(load_dir):
            warnings.warn(f"unable to find a 'latest' file at {load_dir}: nothing loaded", stacklevel=2)
            return None, None
        with_optimizer = load_optimizer_states and not load_module_only
        scheduler = self.lr_scheduler if load_lr_scheduler_states and not load_module_only else None
        try:
            client = self.engine.load_checkpoint(path, strict=load_module_strict,
                                                 load_optimizer_states=with_optimizer, lr_scheduler=scheduler)
        except CheckpointError as exc:
            if _is_deepspeed_folder(path):
                raise CheckpointError(path, "this is a DeepSpeed checkpoint: convert it once with "
                                            f"`zeroshard import deepspeed {path} OUT`, then load OUT") from exc
            raise
        return path, client

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (e.g. mid-construction): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)

    def __repr__(self) -> str:
        return f"DeepSpeedEngine({self.engine!r})"


def _is_deepspeed_folder(folder: str) -> bool:
    import glob

    if glob.glob(os.path.join(folder, "*_optim_states.pt")):
        return True
    try:
        with open(os.path.join(folder, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
    except OSError:
        return False
    return bool(tag) and bool(glob.glob(os.path.join(folder, tag, "*_optim_states.pt")))


def _looks_committed(folder: str) -> bool:
    from zeroshard.format.manifest import LATEST_NAME, MANIFEST_NAME
    from zeroshard.storage.location import Location

    location = Location(folder)
    return location.exists(LATEST_NAME) or location.exists(MANIFEST_NAME)
