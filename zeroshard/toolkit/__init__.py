"""The offline toolkit: shard, reshard, consolidate, inspect, verify (never imports the training core)."""

import zeroshard.interop  # noqa: F401  a foreign folder's errors name its import: See [Note: foreign folders]
