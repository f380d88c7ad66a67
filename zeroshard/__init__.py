"""zeroshard: ZeRO stages 1-3 on torch.distributed, and a streaming checkpoint toolkit.

The toolkit (zeroshard.toolkit, the `zeroshard` command) never imports the training core;
`initialize` and `ZeroConfig` are loaded from zeroshard.engine only when first used.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["initialize", "ZeroConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("initialize", "ZeroConfig"):
        from zeroshard import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")
