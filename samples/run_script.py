"""Run a DeepSpeed training script unchanged, on zeroshard.deepspeed or on real DeepSpeed,
one or more times in one process (each time as if relaunched: its `__main__` runs afresh).

    torchrun --nproc-per-node 2 samples/run_script.py --library zeroshard SCRIPT ARGS [--- ARGS ...]

--library zeroshard points `import deepspeed` (and deepspeed.accelerator, .comm, .zero, ...) at
zeroshard.deepspeed; --library deepspeed imports the real one. `---` separates the argument
lists of successive runs (e.g. a run that saves, then one that resumes): one launch instead of
several, which matters on a small CPU machine.
"""

from __future__ import annotations

import importlib
import pkgutil
import runpy
import sys


def alias_deepspeed() -> None:
    """Make `import deepspeed[.x]` give zeroshard.deepspeed[.x] (only the import changes)."""
    import zeroshard.deepspeed as facade

    sys.modules["deepspeed"] = facade
    for info in pkgutil.walk_packages(facade.__path__, "zeroshard.deepspeed."):
        module = importlib.import_module(info.name)
        sys.modules["deepspeed." + info.name[len("zeroshard.deepspeed."):]] = module


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "--library" or argv[1] not in ("zeroshard", "deepspeed"):
        raise SystemExit("usage: run_script.py --library zeroshard|deepspeed SCRIPT ARGS [--- ARGS ...]")
    if argv[1] == "zeroshard":
        alias_deepspeed()
    script, rest = argv[2], argv[3:]
    runs: list[list[str]] = [[]]
    for arg in rest:
        if arg == "---":
            runs.append([])
        else:
            runs[-1].append(arg)
    for i, args in enumerate(runs):
        if i:
            between_runs()
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


def between_runs() -> None:
    """Every rank finished the previous run before any starts the next, as after a relaunch: a
    file rank 0 alone writes at its end (DeepSpeed-Chat's pytorch_model.bin) is there for every
    rank's next run to read (without this, rank 1 once read it before rank 0 had written it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
