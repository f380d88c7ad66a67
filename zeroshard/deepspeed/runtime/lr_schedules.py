"""deepspeed.runtime.lr_schedules: DeepSpeed's schedule classes where scripts (and Accelerate,
which asks VALID_LR_SCHEDULES whether DeepSpeed holds a scheduler) import them from; they live
in zeroshard/deepspeed/lr_schedules.py."""

from zeroshard.deepspeed.lr_schedules import (
    SCHEDULES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

VALID_LR_SCHEDULES = list(SCHEDULES)  # the names DeepSpeed's config "scheduler" takes

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
