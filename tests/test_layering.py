"""The house rules of the code's layering, checked: the toolkit never imports the training core,
partition arithmetic imports nothing heavy, and the CLI starts without torch."""

import subprocess
import sys


def imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    return set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split())


def test_toolkit_never_imports_the_training_core():
    modules = imported_after("import zeroshard.cli, zeroshard.toolkit.consolidate, zeroshard.toolkit.reshard, "
                             "zeroshard.toolkit.shard, zeroshard.toolkit.verify, zeroshard.toolkit.inspect")
    assert not {m for m in modules if m.startswith(("zeroshard.engine", "zeroshard.checkpointing"))}
    assert "torch" not in modules  # start-up stays fast: torch comes only for a dtype cast


def test_partition_is_pure_arithmetic():
    modules = imported_after("import zeroshard.partition")
    assert not {m for m in modules if m.split(".")[0] in ("torch", "fsspec", "numpy", "safetensors")}
