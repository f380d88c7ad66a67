"""The text a `--dry-run` prints: what a copy reads and writes, and its first and last outputs.
One formatter for both ways of getting the numbers: a Plan's arrays (toolkit/plan.py) and the
sums toolkit/plan_summary.py makes without listing pieces."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


def describe_text(read: int, written: int, inputs_used: int, inputs: int, output_sizes: Sequence[int], pieces: int,
                  casts: Sequence[tuple[str, str] | None], pieces_of: Sequence[int] | np.ndarray,
                  inputs_of: Callable[[int], int], name_of: Callable[[int], str], limit: int = 10) -> str:
    """The dry run's text: totals, then the first and last outputs (limit // 2 each) with their
    pieces and input files. `inputs_of` is asked only for the outputs shown."""
    outputs = [i for i, size in enumerate(output_sizes) if size]  # files with no piece too
    cast_text = ", ".join(f"{a} -> {b}" for a, b in casts[1:]) or "none"  # type: ignore[misc]
    lines = [f"read {read:,} bytes from {inputs_used} of {inputs} input files",
             f"write {sum(output_sizes[i] for i in outputs):,} bytes ({written:,} of tensor data) "
             f"into {len(outputs)} files, in {pieces:,} pieces; casts: {cast_text}"]
    for i in shown_outputs(output_sizes, limit):
        if len(outputs) > limit and i == outputs[-(limit // 2)]:
            lines.append(f"  ... {len(outputs) - 2 * (limit // 2)} more files")
        lines.append(f"  {name_of(i)}: {output_sizes[i]:,} bytes, "
                     f"{int(pieces_of[i]):,} pieces from {int(inputs_of(i)):,} input files")
    return "\n".join(lines)


def shown_outputs(output_sizes: Sequence[int], limit: int = 10) -> list[int]:
    outputs = [i for i, size in enumerate(output_sizes) if size]
    return outputs if len(outputs) <= limit else outputs[:limit // 2] + outputs[-(limit // 2):]
