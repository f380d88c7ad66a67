"""The offline toolkit: shard, reshard, consolidate, inspect, verify (never imports the training core)."""
