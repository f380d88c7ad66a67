"""The environment every benchmark's child processes run in (imported by the bench scripts)."""

from __future__ import annotations

import os
import tempfile


def use_compiled_bytecode() -> str:
    """Make child processes import from compiled bytecode, as an installed package does.

    These machines set PYTHONDONTWRITEBYTECODE, so without this every timed command would compile
    each module it imports from source: tens of milliseconds of start-up no user of an installed
    zeroshard pays. The bytecode goes to a scratch folder (PYTHONPYCACHEPREFIX), not the tree.
    Returns that folder.
    """
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if not os.environ.get("PYTHONPYCACHEPREFIX"):
        os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="zeroshard-bench-pyc-")
    return os.environ["PYTHONPYCACHEPREFIX"]
