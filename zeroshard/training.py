"""What `zeroshard.initialize` returns: the training core (zeroshard.engine) plus checkpoint
conveniences (zeroshard.checkpointing), the layer above both so that neither imports the other
the wrong way round: the engine never imports checkpointing.

`engine.save_checkpoint(...)` / `load_checkpoint(...)` / `load_pretrained(...)` / `wait()` use
one Checkpointer per engine (created on first use: every rank together) that saves the RNG
streams beside the engine; an LR scheduler passed to a call is saved or loaded with it. For
more Stateful objects (a data loader's position, ...), use zeroshard.Checkpointer directly.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch
from torch import nn

from zeroshard.checkpointing import Checkpointer, RNGState
from zeroshard.engine import ZeroConfig, ZeroEngine
from zeroshard.engine.engine import initialize as _initialize_engine
from zeroshard.errors import EngineUsageError


class CheckpointingEngine(ZeroEngine):
    """A ZeroEngine with save_checkpoint / load_checkpoint / load_pretrained / wait."""

    _checkpointer: Checkpointer | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        """This engine's Checkpointer (engine + RNGState); created on first use, collectively."""
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self, RNGState(self.device))
        return self._checkpointer

    def save_checkpoint(self, path: str, tag: str | None = None, client_state: dict | None = None, *,
                        keep_last: int | None = None, async_save: bool = False, lr_scheduler: Any = None,
                        storage_options: dict | None = None, allow_mid_accumulation: bool = False,
                        overwrite: bool = False) -> str:
        """Save to `path/tag` (tag: step-NNNNNNNN by default), every rank writing its own shard;
        rank 0 commits the manifest once all have succeeded, then moves `path/latest`.

        client_state: JSON-serializable dict returned by load_checkpoint. keep_last: prune older
        checkpoints in `path` after the commit. async_save: snapshot now, write in a background
        thread (the next save, wait(), load or exit joins it and raises its error). Returns the
        checkpoint's URL. Raises CheckpointSaveError on every rank if any rank failed. A committed
        checkpoint of this tag is refused, or with overwrite=True replaced once the new one
        commits (the old one stays whole until then; zeroshard.deepspeed passes it, as DeepSpeed
        overwrites).

        Between accumulation boundaries (some micro-batches of the next step already backpropagated)
        the save is refused with EngineUsageError: the accumulated gradients are not saved, so a
        resumed run would update from part of a batch. allow_mid_accumulation=True saves anyway,
        without them (DeepSpeed's behaviour; zeroshard.deepspeed passes it).
        """
        pending = self.pending_micro_batches
        if pending and not allow_mid_accumulation:  # every rank is at the same micro-step: all refuse
            raise EngineUsageError(
                f"save_checkpoint at micro-step {pending} of {self.gradient_accumulation_steps} of global step "
                f"{self.global_steps + 1}: the gradients accumulated so far would not be saved; save right after "
                f"the step() that completes the window (engine.pending_micro_batches == 0)")
        return self.checkpointer.save(path, tag, client_state, keep_last=keep_last, async_save=async_save,
                                      storage_options=storage_options, stateful=_scheduler(lr_scheduler),
                                      overwrite=overwrite)

    def wait(self) -> None:
        """Wait for a background save; raise its error if it failed."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def load_checkpoint(self, path: str, *, strict: bool = True, load_optimizer_states: bool = True,
                        lr_scheduler: Any = None, storage_options: dict | None = None,
                        load_module_only: bool = False) -> Any:
        """Load a checkpoint saved at any world size and stage (a root follows `latest`);
        returns its client_state. strict=False skips parameters missing on either side.
        load_module_only: the weights and buffers only, as DeepSpeed's flag (a warm start: the
        step counters, loss scale, optimizer state and scheduler stay as they are)."""
        return self.checkpointer.load(path, strict=strict, load_optimizer_states=load_optimizer_states,
                                      storage_options=storage_options, stateful=_scheduler(lr_scheduler),
                                      load_module_only=load_module_only)

    def load_pretrained(self, path: str, *, strict: bool = True, storage_options: dict | None = None,
                        strip_prefix: str | list[str] | None = None) -> None:
        """Load model weights from a full model: one .safetensors file or an HF-style folder (or
        their torch.save counterparts); strip_prefix: removed from the file's names ("module.")."""
        self.checkpointer.load_pretrained(path, strict=strict, storage_options=storage_options,
                                          strip_prefix=strip_prefix)

    # State changes other than optimizer steps: an async save still reading the engine's memory
    # gets its copy first (copy-on-write, zeroshard/checkpointing/snapshot.py).

    def restore(self, engine_state: Any, *, strict: bool = True, adopt: bool = False) -> None:
        self._before_state_change()
        super().restore(engine_state, strict=strict, adopt=adopt)

    def load_shards(self, states: Mapping[str, Mapping[str, Any]], strict: bool = True, adopt: bool = False) -> None:
        self._before_state_change()
        super().load_shards(states, strict=strict, adopt=adopt)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        self._before_state_change()
        super().load_full_state_dict(state_dict, strict=strict)

    def _before_state_change(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.before_state_change()


def _scheduler(lr_scheduler: Any) -> dict[str, Any]:
    return {"lr_scheduler": lr_scheduler} if lr_scheduler is not None else {}


def initialize(model: nn.Module,
               optimizer: torch.optim.Optimizer | Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
               config: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None = None, *,
               init_fn: Callable[[nn.Module], None] | None = None) -> CheckpointingEngine:
    """Wrap `model` and `optimizer` in an engine (see zeroshard.engine.initialize) that can also
    save and load checkpoints. optimizer=None: an engine for inference (forward, loads of
    weights, full_state_dict; no backward, step or save_checkpoint)."""
    engine = _initialize_engine(model, optimizer, config, init_fn=init_fn, engine_class=CheckpointingEngine)
    assert isinstance(engine, CheckpointingEngine)
    return engine
