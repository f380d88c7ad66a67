"""Engine checkpoints (training-core side): parallel per-rank save with atomic commit, async
save, and load at any world size and stage. Writes and reads format v1 (docs/FORMAT.md)
through zeroshard.format; the toolkit reads the same files without importing this package."""

from zeroshard.checkpointing.load import load_checkpoint, load_pretrained
from zeroshard.checkpointing.save import CheckpointSaveError, CheckpointSaver

__all__ = ["CheckpointSaveError", "CheckpointSaver", "load_checkpoint", "load_pretrained"]
