"""deepspeed.ops: adam.FusedAdam and adam.DeepSpeedCPUAdam, as torch optimizers."""
from zeroshard.deepspeed.ops import adam  # noqa: F401  (deepspeed.ops.adam.FusedAdam works after import deepspeed)
