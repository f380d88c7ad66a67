"""A save repeated with nothing changed is a no-op, not a refusal.

A committed tag is never overwritten (save.py). But the Hugging Face Trainer saves DeepSpeed's
checkpoint twice into the same tag at stage 3 (once from save_model when the 16-bit weights are
not gathered, once from _save_optimizer_and_scheduler), with no step in between: the second
save would write exactly what is committed. It returns that checkpoint's URL instead, when on
every rank nothing the checkpoint holds has changed since this Checkpointer committed it: no
optimizer step or load (the engine's state-change count), the same client_state, and equal
Stateful states (RNG streams, schedulers) and buffers, as the prepared save encodes them (no
state_dict() is called twice); and rank 0 still finds its manifest. Anything else still gets
the refusal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from zeroshard.agree import gather_all


@dataclass
class SaveFingerprint:
    url: str
    changes: int  # the Checkpointer's count of engine state changes when it was taken
    manifest: str  # client_state and the manifest's extra fields as JSON (rank 0's; empty ones elsewhere)
    rank_state: bytes  # this rank's per-rank Stateful states (RNG streams), as encoded for the file
    buffers: list[torch.Tensor]


def fingerprint(url: str, changes: int, job: Any, rank_state: bytes, module: torch.nn.Module) -> SaveFingerprint:
    """Of a prepared save (save.py's SaveJob): what it would write beyond the engine's tensors,
    which only steps and loads change (counted in `changes`), plus the buffers, which a forward
    in train mode changes without either."""
    manifest = json.dumps([job.client_state, job.manifest_extra], sort_keys=True, default=repr)
    return SaveFingerprint(url, changes, manifest, rank_state, [b.detach().clone() for b in module.buffers()])


def repeats(now: SaveFingerprint, last: SaveFingerprint | None, group: Any,
            committed: Callable[[], bool]) -> bool:
    """Whether `now` is `last` again on every rank (one exchange, only when the URL is the same,
    which every rank sees alike), and rank 0, which wrote its manifest, still finds it committed
    (`committed()`: the folder may have been removed since)."""
    if last is None or now.url != last.url:
        return False
    same = (now.changes == last.changes and now.manifest == last.manifest and now.rank_state == last.rank_state
            and len(now.buffers) == len(last.buffers)
            and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                    for a, b in zip(now.buffers, last.buffers)))
    if same and dist.get_rank(group) == 0:
        same = committed()
    return all(gather_all(same, group, action="checking for a repeated save"))
