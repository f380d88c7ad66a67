"""deepspeed.initialize(...) over zeroshard.initialize."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.deepspeed.config import split_config
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.launch import init_distributed
from zeroshard.deepspeed.lr_schedules import build_scheduler
from zeroshard.deepspeed.optimizers import build_optimizer
from zeroshard.deepspeed.zero import register_engine
from zeroshard.errors import ArgumentTypeError, ConfigError, UnsupportedFeatureError


def _config_from(args: Any, config: Any, config_params: Any) -> Any:
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and from_args is not None:
        raise ConfigError("Not sure how to proceed: a config was given both in the arguments (--deepspeed_config) "
                         "and to initialize()")
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError("no DeepSpeed config: pass config= or --deepspeed_config")
    return config


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config: Any = None, mesh_param: Any = None, config_params: Any = None,
               **unsupported: Any) -> tuple[DeepSpeedEngine, torch.optim.Optimizer, Any, Any]:
    """Returns (engine, optimizer, training_dataloader, lr_scheduler), as DeepSpeed.

    Without an optimizer (none passed, no 'optimizer' section) the engine is for inference, as
    DeepSpeed's at stages 0 and 3 (RLHF reference and reward models, an evaluation-only run):
    forward only, the optimizer and scheduler returned are None, the config's 'scheduler'
    section unused (DeepSpeed configures one only with an optimizer); stages 1-2 are refused,
    as DeepSpeed refuses them ("requires an optimizer")."""
    if unsupported:
        raise ArgumentTypeError(f"initialize() got unsupported arguments: {', '.join(sorted(unsupported))}")
    if model is None:
        raise ConfigError("deepspeed.initialize requires a model")
    if mpu is not None or mesh_param is not None:
        raise UnsupportedFeatureError("deepspeed.initialize(mpu=..., mesh_param=...) (DeepSpeed feature: model/"
                                          "sequence parallelism) is not supported by zeroshard.deepspeed: data "
                                          "parallel only")
    init_distributed(distributed_port=distributed_port)
    split = split_config(_config_from(args, config, config_params), dist.get_world_size(), warn=dist.get_rank() == 0)

    params = list(model_parameters) if model_parameters is not None else [p for p in model.parameters()
                                                                          if p.requires_grad]
    if optimizer is not None and split.optimizer is not None:
        raise ConfigError("an optimizer was passed to initialize() and the config has an 'optimizer' section: "
                         "keep one")
    opt: torch.optim.Optimizer | None
    if optimizer is None and split.optimizer is None:
        if lr_scheduler is not None:
            raise ConfigError("initialize(lr_scheduler=...) without an optimizer: a schedule needs one (pass "
                              "optimizer= or give the config an 'optimizer' section)")
        opt = None  # an engine for inference
    elif optimizer is None:
        opt = build_optimizer(split.optimizer, params)
    elif isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    elif callable(optimizer):  # DeepSpeed calls a client optimizer factory with model_parameters
        opt = optimizer(params)
    else:
        raise ArgumentTypeError(f"optimizer must be a torch optimizer or a callable, not {type(optimizer).__name__}")

    import zeroshard

    native = zeroshard.initialize(model=model, optimizer=opt, config=split.engine)
    if native.stage3_scheduler is not None:  # `model.module.state_dict()` shows partitioned ones empty, as DeepSpeed
        native.stage3_scheduler.released_in_state_dict = "empty"
    register_engine(native)
    # DeepSpeed casts no forward input, except positional ones to fp16 with fp16.auto_cast
    fp16 = split.raw.get("fp16") or {}
    native.cast_inputs = bool(fp16.get("enabled") and fp16.get("auto_cast"))

    if native.optimizer is None:
        scheduler = None
    elif lr_scheduler is not None:
        if split.scheduler is not None:
            warnings.warn("initialize(lr_scheduler=...) given: the config's 'scheduler' section is not used",
                          stacklevel=2)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            scheduler = lr_scheduler(native.optimizer)
        else:
            scheduler = lr_scheduler
            scheduler.optimizer = native.optimizer  # the same one, unless a factory or the config built it
    elif split.scheduler is not None:
        scheduler = build_scheduler(split.scheduler, native.optimizer)
    else:
        scheduler = None

    engine = DeepSpeedEngine(native, scheduler, split)
    loader = None
    if training_data is not None:
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(training_data, num_replicas=native.world_size, rank=native.rank)
        loader = DataLoader(training_data, batch_size=split.micro_batch, sampler=sampler, collate_fn=collate_fn,
                            drop_last=split.dataloader_drop_last, pin_memory=native.device.type == "cuda")
    return engine, native.optimizer, loader, scheduler
