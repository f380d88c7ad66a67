"""`zeroshard estimate`: per-GPU model-state memory by the ZeRO paper's formulas (pure arithmetic).

Mixed precision (bf16/fp16) with Adam, Ψ parameters, N GPUs (Rajbhandari et al., 2020, §3-5):
fp16/bf16 parameters 2Ψ, gradients 2Ψ, optimizer states KΨ with K = 12 (fp32 master weights,
momentum and variance: 4 + 4 + 4 bytes). Stage 1 partitions the optimizer states (KΨ/N),
stage 2 also the gradients ((2 + K)Ψ/N), stage 3 also the parameters ((2 + 2 + K)Ψ/N).
Stage 0 is plain data parallelism (DDP), nothing partitioned.

fp32 training (our assumption, the paper gives no fp32 row): parameters 4Ψ, gradients 4Ψ and
Adam's two moments 8Ψ (K = 8); the parameters are their own master weights, so there is no
extra copy. Partitioning follows the same stage rules.

Model states only: activations, temporary buffers and fragmentation come on top. The
zeroshard engine's own accounting (engine.memory_report) differs in one place: it keeps the
reduced gradient shard in fp32 (4Ψ/N instead of 2Ψ/N at stages 2-3), see docs/ENGINE.md.
GB here means 10^9 bytes, as in the paper's Table 1 (7.5B params, 64 GPUs: 120 / 31.4 / 16.6 /
1.88 GB for DDP / stage 1 / 2 / 3).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import click

from zeroshard.errors import ConfigError

BYTES = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}  # (params, grads, optimizer) per param
STAGE_NAMES = {0: "DDP (stage 0)", 1: "ZeRO-1 (P_os)", 2: "ZeRO-2 (P_os+g)", 3: "ZeRO-3 (P_os+g+p)"}
_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


@dataclass(frozen=True)
class Estimate:
    """Model-state bytes per GPU."""

    stage: int
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def parse_count(text: str | float | int) -> float:
    """'7.5B' -> 7.5e9; also K/M/G/T suffixes, plain numbers and '1.3e9'."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
        if not m:
            raise ConfigError(f"not a parameter count: {text!r} (examples: 7.5B, 350M, 1.3e9)")
        value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value <= 0:
        raise ConfigError(f"parameter count must be positive, got {text!r}")
    return value


def model_state_bytes(params: float, gpus: int, stage: int, dtype: str = "bf16") -> Estimate:
    """Per-GPU bytes of parameters, gradients and optimizer states at ZeRO `stage`."""
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage must be 0-3, got {stage}")
    if gpus < 1:
        raise ConfigError(f"gpus must be >= 1, got {gpus}")
    if dtype not in BYTES:
        raise ConfigError(f"dtype must be one of {sorted(BYTES)}, got {dtype!r}")
    p, g, k = (b * params for b in BYTES[dtype])
    return Estimate(stage, p / gpus if stage >= 3 else p, g / gpus if stage >= 2 else g,
                    k / gpus if stage >= 1 else k)


def fmt_gb(nbytes: float) -> str:
    """Bytes as GB (1e9) with three significant digits, never in exponent form: 120, 31.4, 1.88."""
    gb = nbytes / 1e9
    if gb == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(gb))))
    return f"{gb:.{decimals}f}"


def table(params: float, gpus: int, stages: list[int], dtype: str = "bf16") -> str:
    rows = [("stage", "params GB", "grads GB", "optimizer GB", "total GB")]
    for s in stages:
        e = model_state_bytes(params, gpus, s, dtype)
        rows.append((STAGE_NAMES[s], fmt_gb(e.params), fmt_gb(e.grads), fmt_gb(e.optimizer), fmt_gb(e.total)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(lines)


@click.command("estimate")
@click.option("--params", "params", required=True, help="Parameter count, e.g. 7.5B, 350M, 1.3e9.")
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="Data-parallel GPUs (N).")
@click.option("--stage", type=click.IntRange(0, 3), default=None, help="Only this stage (default: all).")
@click.option("--dtype", type=click.Choice(sorted(BYTES)), default="bf16", show_default=True,
              help="Training precision: bf16/fp16 = mixed precision (K=12), fp32 = 4+4+8 bytes.")
def estimate_command(params: str, gpus: int, stage: int | None, dtype: str) -> None:
    """Per-GPU model-state memory (params, grads, Adam states) by the ZeRO formulas."""
    try:
        count = parse_count(params)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--params") from e
    stages = [stage] if stage is not None else [0, 1, 2, 3]
    click.echo(f"{count:,.0f} parameters, {gpus} GPUs, {dtype} "
               f"({'2+2+12' if dtype != 'fp32' else '4+4+8'} bytes/param unpartitioned); GB = 1e9 bytes")
    click.echo(table(count, gpus, stages, dtype))
