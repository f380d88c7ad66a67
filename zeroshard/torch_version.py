"""The oldest torch zeroshard's training core and importers run on: pyproject.toml's `torch>=X`,
tested in CI by `tools/dev.sh floor` (tests/test_packaging.py keeps the three in step).

pip enforces the floor, but `pip install --no-deps`, a conda environment or a vendored torch
skip it, and below it the failures are far from their cause: stage 3 stops at `initialize` on
torch 2.4 (no `register_state_dict_post_hook`), the importers' pickle allowlist on 2.4-2.5
(`safe_globals`), ranks hang at teardown on 2.6. So the packages that use those APIs check
first and say what to do in one line.
"""

from __future__ import annotations

import functools
import os
import re
import warnings

from zeroshard.errors import ZeroshardError

TORCH_FLOOR = (2, 8)
SKIP_VARIABLE = "ZEROSHARD_SKIP_TORCH_CHECK"


def torch_release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a torch version string ("2.13.0+cpu", "2.16.0.dev20261101"); None if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


@functools.cache
def require_supported_torch() -> None:
    """Raise ZeroshardError when the installed torch is below TORCH_FLOOR (a warning instead with
    ZEROSHARD_SKIP_TORCH_CHECK=1); an unreadable version passes."""
    import torch

    release = torch_release(torch.__version__)
    if release is None or release >= TORCH_FLOOR:
        return
    floor = ".".join(map(str, TORCH_FLOOR))
    message = (f"zeroshard needs torch>={floor}; this environment has torch {torch.__version__} (installed "
               f"without pip's check?): install the torch {floor}+ build for your CUDA first")
    if os.environ.get(SKIP_VARIABLE) == "1":
        warnings.warn(f"{message} ({SKIP_VARIABLE}=1: going on untested)", stacklevel=2)
        return
    raise ZeroshardError(f"{message}, or set {SKIP_VARIABLE}=1 to try anyway (untested below {floor})")
