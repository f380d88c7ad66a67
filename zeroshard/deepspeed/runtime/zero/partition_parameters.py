"""deepspeed.runtime.zero.partition_parameters.ZeroParamStatus, which scripts test to pick the
stage-3 parameters to gather (DeepSpeed-Chat's `_z3_params_to_fetch`, OpenRLHF's alike)."""

from __future__ import annotations

from enum import Enum


class ZeroParamStatus(Enum):
    """A stage-3 parameter's `ds_status` (zeroshard.deepspeed.zero tags the parameters)."""
    AVAILABLE = 1  # inside GatheredParameters: the full value is there
    NOT_AVAILABLE = 2  # partitioned: only this rank's share exists
    INFLIGHT = 3  # DeepSpeed's prefetch in flight; never seen here
