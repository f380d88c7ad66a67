"""Engine checkpoints (training-core side): parallel per-rank save with atomic commit, async
save, and load at any world size and stage, through the engine's checkpoint contract
(checkpoint_state/restore). Writes and reads the format of docs/FORMAT.md through
zeroshard.format; the toolkit reads the same files without importing this package.

  checkpointer.py  Checkpointer: the gloo group, the background save, save/load/wait
  contents.py      an EngineState in format terms (tensors, manifest fields)
  save.py          the save protocol: claim, write, agree, commit, prune
  load.py          reading this rank's ranges back into an EngineState
  snapshot.py      the copy an async save takes while training waits
  stateful.py      Stateful objects (LR schedulers, RNGState, ...) and rank-state blobs
  tiers.py         TierPolicy: memory and durable tiers, how often each (docs/RECOVERY.md)
  memory_tier.py   a node's tmpfs folder of checkpoints: space check, prune, the memory save
  replicas.py      which node keeps a copy of which rank file; files sent between ranks
  recovery.py      load from the best tier: newest verified memory checkpoint, else durable
"""

from zeroshard.checkpointing.checkpointer import Checkpointer
from zeroshard.checkpointing.stateful import RNGState, Stateful
from zeroshard.checkpointing.tiers import TierPolicy
from zeroshard.errors import CheckpointSaveError

__all__ = ["Checkpointer", "CheckpointSaveError", "RNGState", "Stateful", "TierPolicy"]
