"""`import zeroshard.deepspeed as deepspeed`: DeepSpeed's training-script API over zeroshard.

A thin layer: initialize() builds the optimizer and LR schedule from the DeepSpeed config,
calls zeroshard.initialize, and wraps the native ZeroEngine in a DeepSpeedEngine with
DeepSpeed's method names. See docs/DEEPSPEED.md for what is supported, ignored and refused.

  launch.py        add_config_arguments, init_distributed
  config.py        splitting the DeepSpeed config; batch sizes; DeepSpeed's defaults
  optimizers.py    the config's "optimizer" section
  lr_schedules.py  WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest (DeepSpeed's arithmetic)
  initialize.py    initialize()
  engine.py        DeepSpeedEngine
  zero.py          zero.Init, zero.GatheredParameters
  accelerator.py   get_accelerator()
  comm.py, moe/    the names scripts import from deepspeed.comm and deepspeed.moe.utils
  ops/adam.py      FusedAdam, DeepSpeedCPUAdam (as torch's AdamW/Adam)
  runtime/         runtime.zero.partition_parameters.ZeroParamStatus
  model_file.py    save_16bit_model's safetensors file
"""

from zeroshard.deepspeed import comm, lr_schedules, ops, zero  # noqa: F401
from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.initialize import initialize
from zeroshard.deepspeed.launch import add_config_arguments, init_distributed

__all__ = ["initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine", "zero", "comm",
           "lr_schedules", "ops", "get_accelerator"]
