"""deepspeed.utils: the `logger` the Hugging Face Trainer sets the level of (DeepSpeed's logger
is named "DeepSpeed"; zeroshard.deepspeed logs nothing through it)."""

from __future__ import annotations

import logging

logger = logging.getLogger("DeepSpeed")

__all__ = ["logger"]
