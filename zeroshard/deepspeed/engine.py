"""DeepSpeedEngine: DeepSpeed's engine surface over a native ZeroEngine.

Like DeepSpeed's, the engine is an nn.Module whose one submodule is the wrapped model,
`module`: parameters(), named_parameters(), state_dict() keys (`module.`-prefixed; at stage 3
partitioned parameters are empty tensors, set up in initialize.py), modules(), buffers(),
forward hooks and train()/eval() behave as on DeepSpeed's engine. Training is
delegated to the native engine (`.engine`); what differs from the native API is DeepSpeed's
spelling: batch sizes and flags are methods, the LR scheduler is stepped inside step() after
every applied optimizer step, save_checkpoint returns True, load_checkpoint returns
(path, client_state) and leaves the RNG streams alone. An attribute not found here is looked
up on the model (as DeepSpeed does), then on the native engine. DeepSpeed features the facade
does not have raise a one-line UnsupportedFeatureError (surface.py); docs/DEEPSPEED.md has
the audit table.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping

import torch
from torch import nn

from zeroshard.checkpointing import RNGState
from zeroshard.checkpointing.load import UNRESTORED
from zeroshard.deepspeed.config import map_offload
from zeroshard.deepspeed.model_file import save_model_file
from zeroshard.deepspeed.surface import DEEPSPEED_ENGINE_NAMES, refusal
from zeroshard.errors import CheckpointError, EngineUsageError

# DeepSpeed getters for features zeroshard does not have: they answer "disabled", as DeepSpeed
# does when the config leaves them out (scripts and Accelerate branch on them).
_DISABLED = ("wall_clock_breakdown", "flops_profiler_enabled", "autotuning_enabled", "memory_breakdown",
             "curriculum_learning_enabled", "data_efficiency_enabled", "data_sampling_enabled",
             "random_ltd_enabled", "is_sanity_checks_enabled", "torch_autocast_enabled",
             "is_deepcompile_enabled", "is_deepcompile_active", "zero_nvme_offload_optimizer",
             "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
             "zero_legacy_stage1", "zero_elastic_checkpoint", "use_node_local_storage",
             "checkpoint_writer_enabled", "fp16_master_weights_and_gradients", "bf16_master_weights_and_gradients",
             "uses_parallelization_pass_only", "compile_autosp", "compile_autotp")


class DeepSpeedEngine(nn.Module):
    def __init__(self, engine: Any, lr_scheduler: Any, split: Any) -> None:
        super().__init__()
        self.engine = engine  # not an nn.Module: not registered, so parameters appear once, under module.
        # as DeepSpeed's _set_client_model: registered (nn.Module methods see it) and in __dict__
        self._modules["module"] = engine.module
        self.__dict__["module"] = engine.module
        self.lr_scheduler = lr_scheduler
        self._split = split
        self.config = split.raw
        self.local_rank = int(os.environ.get("LOCAL_RANK", engine.rank))
        self.global_rank = engine.rank
        self.world_size = self.dp_world_size = engine.world_size
        self.device = engine.device
        self.optimizer = engine.optimizer
        self._step_applied = False

    # -- training ----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        if retain_graph:
            raise refusal("backward(retain_graph=True)")
        self.engine.backward(loss, scale_wrt_gas=scale_wrt_gas)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """A micro-step; at the boundary the optimizer step, then the scheduler unless fp16 overflowed.

        After a boundary step the module's parameters hold the new weights, as DeepSpeed's do:
        scripts read `engine.module` directly (`torch.save(model.module.state_dict())` on rank 0,
        DeepSpeed-Chat's save_hf_format), which the native engine's parameter all-gathers, left
        in flight for the next forward (stages 1-2), would otherwise give before the update."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self.engine.step()
        if boundary:
            self.engine.wait_params()  # every rank steps: the gathers still to launch are collective
            self._step_applied = self.engine.skipped_steps == skipped
        if boundary and self._step_applied and self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's override of the boundary (Accelerate sets it before every backward and calls
        step() once per window): the native engine's set_gradient_accumulation_boundary."""
        self.engine.set_gradient_accumulation_boundary(is_boundary)

    def was_step_applied(self) -> bool:
        """Whether the last boundary step updated the weights (False after an fp16 overflow)."""
        return self._step_applied

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are already released after each step()."""

    def train(self, mode: bool = True) -> "DeepSpeedEngine":
        # the model's flags only: DeepSpeed's engine leaves its own `training` at True
        self.engine.train(mode)
        return self

    def eval(self) -> "DeepSpeedEngine":
        return self.train(False)

    def destroy(self) -> None:
        """Waits for a background save (DeepSpeed frees its buffers here)."""
        wait = getattr(self.engine, "wait", None)
        if wait is not None:
            wait()

    def empty_partition_cache(self) -> None:
        """Stage 3 releases gathered parameters after each use already."""

    # -- nn.Module surface: the parameters live in the native engine ---------------------------
    def to(self, *args: Any, **kwargs: Any) -> "DeepSpeedEngine":
        """A no-op for the engine's own device (and compute dtype); anything else is refused."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        same_device = device is None or (device.type == self.device.type
                                         and device.index in (None, self.device.index))
        if same_device and dtype in (None, self.engine.compute_dtype):
            return self
        given = ", ".join([*map(str, args), *(f"{k}={v}" for k, v in kwargs.items())])
        raise refusal(f"to({given}) (moving or casting the engine; it is on {self.device})")

    def cuda(self, device: Any = None) -> "DeepSpeedEngine":
        return self.to(torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"))

    def cpu(self) -> "DeepSpeedEngine":
        return self.to("cpu")

    def compile(self, *args: Any, **kwargs: Any) -> None:
        raise refusal("compile")

    def _apply(self, fn: Any, recurse: bool = True) -> "DeepSpeedEngine":
        # half(), float(), bfloat16(), double(), type(), to_empty(): the native engine owns the storage
        raise refusal("half()/float()/bfloat16()/double()/type() (casting the engine's parameters: "
                      "choose bf16/fp16 in the config)")

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> Any:
        out = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    out.pop(prefix + name, None)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """`module.`-prefixed keys (what state_dict() gives), full tensors, at any stage: written
        into the fp32 masters as well as the parameters (collective-free)."""
        if assign:
            raise refusal("load_state_dict(assign=True)")
        ours = set(self.module.state_dict().keys())
        inner = {k[len("module."):]: v for k, v in state_dict.items() if k.startswith("module.")}
        missing = sorted(f"module.{k}" for k in ours - set(inner))
        unexpected = sorted([k for k in state_dict if not k.startswith("module.")]
                            + [f"module.{k}" for k in set(inner) - ours])
        if strict and (missing or unexpected):
            raise EngineUsageError(f"DeepSpeedEngine.load_state_dict: missing keys {missing[:5]}, "
                                   f"unexpected keys {unexpected[:5]} (strict=False to skip them)")
        self.engine.load_full_state_dict({k: v for k, v in inner.items() if k in ours}, strict=False)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """Collective: the full weights on rank 0, in the parameters' dtype ({} elsewhere), as DeepSpeed."""
        full = self.engine.full_state_dict()
        dtypes = {n: p.dtype for n, p in self.module.named_parameters(remove_duplicate=False)}
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        return {k: (v.to(dtypes[k]) if k in dtypes else v) for k, v in full.items()
                if not (exclude_frozen_parameters and k in frozen)}

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

    def fp16_auto_cast(self) -> bool:
        """Whether forward casts floating inputs (fp16 with `auto_cast`; else none, as DeepSpeed)."""
        return self.engine.cast_inputs

    def _groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups; none for an engine built without one (as DeepSpeed's getters)."""
        return self.engine.optimizer.param_groups if self.engine.optimizer is not None else []

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self._groups()]

    def get_global_grad_norm(self) -> float | None:
        """The pre-clipping global norm of the last step (None when neither clipping nor fp16 computed it)."""
        return self.engine.last_grad_norm

    def get_loss_scale(self) -> float:
        return self.engine.loss_scale

    def loss_scale(self) -> float:
        """The config's static fp16 loss scale (0: dynamic), as DeepSpeed's loss_scale()."""
        return float(self.config.get("fp16", {}).get("loss_scale", 0))

    def dynamic_loss_scale(self) -> bool:
        return self.fp16_enabled() and self.loss_scale() == 0

    def get_mom(self) -> list[Any]:
        return [g.get("betas", (g.get("momentum"),))[0] for g in self._groups()]

    def get_batch_info(self) -> tuple[int, int, int]:
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def get_data_parallel_rank(self) -> int:
        return self.engine.rank

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_parallel_rank = get_model_parallel_rank

    def steps_per_print(self) -> int | None:
        return self.config.get("steps_per_print")

    def dataloader_drop_last(self) -> bool:
        return self._split.dataloader_drop_last

    def optimizer_name(self) -> str | None:
        """The config's optimizer type; a client optimizer's class name, as DeepSpeed."""
        if self._split.optimizer is None:
            return type(self.engine.optimizer).__name__ if self.engine.optimizer is not None else None
        return self._split.optimizer.get("type")

    def optimizer_params(self) -> dict | None:
        return (self._split.optimizer or {}).get("params")

    def scheduler_name(self) -> str | None:
        return (self._split.scheduler or {}).get("type")

    def scheduler_params(self) -> dict | None:
        return (self._split.scheduler or {}).get("params")

    def zero_optimization_partition_gradients(self) -> bool:
        return self.engine.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.engine.stage >= 3

    def _zero_config(self) -> dict:
        return self.config.get("zero_optimization", {}) or {}

    def zero_offload_optimizer(self) -> dict | None:
        return map_offload(self._zero_config()).get("offload_optimizer")

    def zero_offload_param(self) -> dict | None:
        """The offload_param section as mapped (deprecated cpu_offload_param included); None when off."""
        spec = map_offload(self._zero_config()).get("offload_param")
        return spec if spec and spec.get("device", "none") != "none" else None

    def zero_hpz_partition_size(self) -> int:
        """ZeRO++'s secondary partition size (1: off), as the config gives it."""
        return int(self._zero_config().get("zero_hpz_partition_size", 1) or 1)

    def zero_cpu_offload(self) -> bool:
        return (self.zero_offload_optimizer() or {}).get("device") == "cpu"

    def zero_allow_untested_optimizer(self) -> bool:
        return bool(self.config.get("zero_allow_untested_optimizer", False))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        zero = self._zero_config()
        return bool(zero.get("stage3_gather_16bit_weights_on_model_save",
                             zero.get("gather_16bit_weights_on_model_save", False)))

    @property
    def is_compiled(self) -> bool:
        return False

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save to save_dir/tag (tag: global_step{N}, as DeepSpeed); client_state must be JSON data.
        Between accumulation boundaries it saves without the accumulated gradients, as DeepSpeed does
        (zeroshard's own save_checkpoint refuses there). A committed checkpoint of this tag is
        replaced, as DeepSpeed does (the HF Trainer resumed from an earlier checkpoint saves its later
        ones again), but only once the new one is committed: until then the old one stays whole."""
        if not save_latest or exclude_frozen_parameters:
            raise refusal("save_checkpoint(save_latest=False / exclude_frozen_parameters=True)")
        tag = str(tag) if tag is not None else f"global_step{self.engine.global_steps}"  # DeepSpeed allows ints
        self.engine.save_checkpoint(os.fspath(save_dir), tag, client_state=dict(client_state or {}),
                                    lr_scheduler=self.lr_scheduler, allow_mid_accumulation=True, overwrite=True)
        return True

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The full weights in their compute dtype, one file written by rank 0: safetensors, not a
        pickle, so `pytorch_model.bin` becomes `model.safetensors` (deepspeed/model_file.py).
        Collective. At stage 3 without `stage3_gather_16bit_weights_on_model_save`: nothing
        saved, False, as DeepSpeed (which says so only at info level; this warns)."""
        if self.engine.stage == 3 and not self.zero_gather_16bit_weights_on_model_save():
            if self.engine.rank == 0:
                warnings.warn("save_16bit_model: nothing saved: stage 3 needs zero_optimization."
                              "stage3_gather_16bit_weights_on_model_save: true, as DeepSpeed", stacklevel=2)
            return False
        save_model_file(self.engine, self.module, save_dir, save_filename, exclude_frozen_parameters)
        return True

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name for save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None, *,
                        load_rng_states: bool = False) -> tuple[str | None, Any]:
        """Load load_dir/tag (or what load_dir/latest names); (None, None) when there is no
        `latest`, as DeepSpeed. Returns (checkpoint path, client_state).

        The RNG streams (torch, CUDA, NumPy, Python) are left as they are, as DeepSpeed does:
        a resumed script draws its dropout masks from wherever its own seeding put them.
        load_rng_states=True (zeroshard only) restores the streams saved with the checkpoint
        (same world size), so that a resumed run continues exactly like an uninterrupted one."""
        if custom_load_fn is not None:
            raise refusal("load_checkpoint(custom_load_fn=...)")
        load_dir = os.fspath(load_dir)
        path = load_dir if tag is None else os.path.join(load_dir, str(tag))
        if tag is None and not _looks_committed(load_dir):
            warnings.warn(f"unable to find a 'latest' file at {load_dir}: nothing loaded", stacklevel=2)
            return None, None
        with_optimizer = load_optimizer_states and not load_module_only
        scheduler = self.lr_scheduler if load_lr_scheduler_states and not load_module_only else None
        # the native load restores the saved RNG streams; DeepSpeed's never touches them
        rng = None if load_rng_states else RNGState(self.device)
        before = rng.state_dict() if rng is not None else None
        try:
            with warnings.catch_warnings():
                if not load_lr_scheduler_states:  # skipped on purpose: no warning that it was not restored
                    warnings.filterwarnings("ignore", message=f".*{UNRESTORED}")
                client = self.engine.load_checkpoint(path, strict=load_module_strict,
                                                     load_optimizer_states=with_optimizer, lr_scheduler=scheduler,
                                                     load_module_only=load_module_only)
        except CheckpointError as exc:
            if _is_deepspeed_folder(path):
                raise CheckpointError(path, "this is a DeepSpeed checkpoint: convert it once with "
                                            f"`zeroshard import deepspeed {path} OUT`, then load OUT") from exc
            raise
        finally:
            if rng is not None:
                rng.load_state_dict(before)
        return path, client

    def __getattr__(self, name: str) -> Any:
        """Registered submodules/parameters (nn.Module), then the model's attributes (as
        DeepSpeed), then the native engine's. DeepSpeed engine features not provided: refused."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        if name in ("engine", "module") or name.startswith("__"):  # mid-construction, copy, pickle
            raise AttributeError(name)  # internal: __getattr__ protocol (copy/pickle probe)
        if name in DEEPSPEED_ENGINE_NAMES:
            raise refusal(name)
        for owner in (self.__dict__.get("module"), self.__dict__.get("engine")):
            if owner is not None:
                try:
                    return getattr(owner, name)
                except AttributeError:
                    pass
        raise AttributeError(  # internal: the __getattr__ protocol, worded as Python words it
            f"'{type(self).__name__}' object has no attribute '{name}'")


def _disabled(self: DeepSpeedEngine) -> bool:
    return False


for _name in _DISABLED:
    setattr(DeepSpeedEngine, _name, _disabled)


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
