"""ZeRO-Offload of the optimizer: fp32 masters, their gradients and optimizer state in host memory.

With `zero_optimization.offload_optimizer: {"device": "cpu", "pin_memory": true}` every master
chunk (and so the optimizer state the optimizer creates beside it, and the fp32 gradient shard
the reducer accumulates into it) lives on the CPU, and `optimizer.step()` runs there. The
device keeps only what forward/backward need: the compute-dtype parameters (whole at stages
1-2, gathered per unit at stage 3) and the gradient buckets in flight.

Traffic per step: each reduced gradient bucket's share comes down to the host as it finishes
(during backward at stages 2-3); updated masters go up inside the parameter all-gather, which
reads them straight from host memory (from pinned memory the copy is asynchronous on the
current stream, ordered before the collective that consumes it). On a CPU-only machine the
"device" is the CPU too: the same code path runs, with no copies.
"""

from __future__ import annotations

import torch

from zeroshard.engine.config import ZeroConfig


def master_device(config: ZeroConfig, device: torch.device) -> tuple[torch.device, bool]:
    """Where the fp32 masters live, and whether their memory is pinned."""
    spec = config.zero_optimization.offload_optimizer or {}
    if spec.get("device", "none") in (None, "none"):
        return device, False
    pin = bool(spec.get("pin_memory", False)) and device.type == "cuda"
    return torch.device("cpu"), pin


def host_zeros(numel: int, pin: bool) -> torch.Tensor:
    """A zeroed fp32 host tensor (page-locked when `pin`, so device copies can be asynchronous)."""
    return torch.zeros(numel, dtype=torch.float32, pin_memory=pin)
