"""`zeroshard estimate --plot FILE`: the ZeRO paper's picture, model-state memory per device
against the number of devices, one line per stage (plus stage 3 with the optimizer offloaded),
from zeroshard.estimate's formulas. Needs matplotlib (the `plot` extra)."""

from __future__ import annotations

from zeroshard.errors import ZeroshardError
from zeroshard.estimate import BYTES, STAGE_NAMES, model_state_bytes

PLOT_EXTRA_HINT = "--plot needs the plot extra: pip install 'zeroshard[plot]'"


def device_counts(gpus: int) -> list[int]:
    """Powers of two from 1 to at least 4x `gpus` (and at least 1,024), with `gpus` itself."""
    top = max(1024, 4 * gpus)
    counts = [2**i for i in range((top - 1).bit_length() + 1)]  # up to the first power of two >= top
    return sorted(set(counts) | {gpus})


def plot_memory(params: float, gpus: int, out: str, dtype: str = "bf16") -> str:
    """Draw GB per device against device count for stages 0-3 and stage 3 + optimizer offload; save to `out`."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ZeroshardError(PLOT_EXTRA_HINT) from None
    xs = device_counts(gpus)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for stage in (0, 1, 2, 3):
        ys = [model_state_bytes(params, n, stage, dtype).total / 1e9 for n in xs]
        ax.plot(xs, ys, marker=".", label=STAGE_NAMES[stage])
    p, g, _ = BYTES[dtype]  # offloaded optimizer: masters and moments live in host memory
    ax.plot(xs, [(p + g) * params / n / 1e9 for n in xs], linestyle="--", label="ZeRO-3 + optimizer offload")
    ax.axvline(gpus, color="grey", linewidth=0.8)
    for stage in (0, 3):
        y = model_state_bytes(params, gpus, stage, dtype).total / 1e9
        ax.annotate(f"{y:.3g} GB", (gpus, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices (data-parallel)")
    ax.set_ylabel("model-state memory per device (GB)")
    ax.set_title(f"{params / 1e9:.3g}B parameters, {dtype}, Adam: ZeRO stages")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out)
    except OSError as exc:
        raise ZeroshardError(f"{out}: cannot write the plot ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)
    return out
