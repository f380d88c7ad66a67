"""zeroshard: ZeRO stages 1-3 on torch.distributed, and a streaming checkpoint toolkit.

The toolkit (zeroshard.toolkit, the `zeroshard` command) never imports the training core;
`initialize` and `ZeroConfig` are loaded from zeroshard.engine only when first used.
"""

from typing import Any

from zeroshard.errors import CheckpointError, StorageError, ZeroshardError

__version__ = "0.1.0"
__all__ = ["initialize", "zero_init", "ZeroConfig", "ZeroEngine", "CheckpointSaveError", "ZeroshardError", "CheckpointError",
           "StorageError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("initialize", "zero_init", "ZeroConfig", "ZeroEngine"):
        from zeroshard import engine

        return getattr(engine, name)
    if name == "CheckpointSaveError":
        from zeroshard.checkpointing import CheckpointSaveError

        return CheckpointSaveError
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")
