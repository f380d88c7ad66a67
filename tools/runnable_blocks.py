"""The Python blocks in a Markdown file that are meant to run (tests/test_readme.py runs them on
CPU ranks; tools/gpu_suite.py runs the README's torchrun block on GPUs).

A block runs when the line before its ```python fence is a marker:

    <!-- runnable -->               python, alone
    <!-- runnable: torchrun 2 -->   under torchrun with 2 ranks
"""

from __future__ import annotations

import re
from pathlib import Path

MARKER = re.compile(r"^<!-- runnable(?::\s*torchrun (\d+))?\s*-->\s*$")


def runnable_blocks(path: Path) -> list[tuple[int, int, str]]:
    """(line, ranks, code) of each marked python block; ranks 0 means plain python."""
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines[:-1]):
        m = MARKER.match(line.strip())
        if not m:
            continue
        if lines[i + 1].strip() != "```python":
            raise ValueError(f"{path.name}:{i + 1}: a runnable marker must precede ```python")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        blocks.append((i + 1, int(m.group(1) or 0), "\n".join(lines[i + 2:end]) + "\n"))
    return blocks
