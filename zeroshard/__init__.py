"""zeroshard: ZeRO stages 1-3 on torch.distributed, and a streaming checkpoint toolkit.

The toolkit (zeroshard.toolkit, the `zeroshard` command) never imports the training core;
`initialize`, `ZeroConfig`, `Checkpointer` and the rest are loaded only when first used.
Every error zeroshard raises on purpose is a ZeroshardError (zeroshard/errors.py).
"""

from typing import Any

from zeroshard.errors import (
    ArgumentTypeError,
    CheckpointError,
    CheckpointSaveError,
    ClaimError,
    ConfigError,
    EngineUsageError,
    InvalidArgumentError,
    MissingKeyError,
    OtherRanksFailedError,
    OutputExistsError,
    PeerLostError,
    RanksBuiltDifferentModelsError,
    StorageError,
    UnsupportedFeatureError,
    ZeroshardError,
)

__version__ = "0.1.0"
__all__ = ["initialize", "zero_init", "ZeroConfig", "ZeroEngine", "CheckpointingEngine", "Checkpointer",
           "TierPolicy", "RNGState", "Stateful", "EngineState", "ZeroshardError", "CheckpointError", "StorageError",
           "ClaimError", "OutputExistsError", "CheckpointSaveError", "OtherRanksFailedError", "PeerLostError",
           "ConfigError", "InvalidArgumentError", "ArgumentTypeError", "MissingKeyError",
           "EngineUsageError", "RanksBuiltDifferentModelsError", "UnsupportedFeatureError",
           "load_state_dict", "open_tensors",
           "__version__"]

_LAZY = {"initialize": "zeroshard.training", "CheckpointingEngine": "zeroshard.training",
         "zero_init": "zeroshard.engine", "ZeroConfig": "zeroshard.engine", "ZeroEngine": "zeroshard.engine",
         "EngineState": "zeroshard.engine.contract", "Checkpointer": "zeroshard.checkpointing",
         "RNGState": "zeroshard.checkpointing", "Stateful": "zeroshard.checkpointing",
         "TierPolicy": "zeroshard.checkpointing",
         # the offline reader: the toolkit's, no process group and no training core
         "load_state_dict": "zeroshard.toolkit.load", "open_tensors": "zeroshard.toolkit.load"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")  # internal: module __getattr__ protocol
