"""Async saves: the rank's state written on a background thread while training goes on.

What training waits for is made as small as possible:
- tensors that only an optimizer step changes (the fp32 masters and per-element optimizer state,
  when they live in host memory) are not copied at all when the save starts: the background
  writer reads them in place, and *copy-on-write* protects them: the next optimizer step (or any
  restore/load into the engine) first calls `BackgroundSave.detach()`, which copies whatever the
  writer has not written yet. When the write finishes before the next step, as it does when a
  step takes longer than a save, nothing is ever copied;
- everything else (buffers, which a forward may change, and tensors on a GPU) is copied at once,
  into buffers kept from save to save (allocating, and first touching, fresh memory costs
  several times the copy itself), pinned on CUDA with asynchronous device-to-host copies.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from zeroshard.checkpointing.contents import Held, RankContents


class Snapshot:
    """Reusable host copies of a list of 1-D tensors (the buffers follow the tensors' sizes)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def take(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` (1-D), valid until the next take()."""
        cuda = any(t.device.type == "cuda" for t in tensors)
        out = []
        for i, t in enumerate(tensors):
            if i >= len(self.buffers):
                self.buffers.append(torch.empty(0, dtype=torch.uint8))
            nbytes = t.numel() * t.element_size()
            if self.buffers[i].numel() != nbytes:
                self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
            out.append(self.buffers[i].view(t.dtype) if nbytes else torch.empty(0, dtype=t.dtype))
        del self.buffers[len(tensors):]
        for dst, src in zip(out, tensors):
            dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        return out


class BackgroundSave:
    """The contents of one async save, safe to write on another thread while training runs."""

    def __init__(self, contents: RankContents, eager: Snapshot, lazy: Snapshot) -> None:
        self.contents = contents
        self._lazy = lazy
        self._lock = threading.Lock()
        self._written: set[str] = set()
        self._detached = False
        # copied now: what a forward may change, and what is not in host memory
        live = {name for name, held in contents.held.items()
                if name in contents.stepped and held.tensor.device.type == "cpu"}
        now = [name for name in contents.held if name not in live]
        for name, copy in zip(now, eager.take([contents.held[n].tensor for n in now])):
            contents.held[name] = Held(copy, contents.held[name].start)
        self._live = [name for name in contents.held if name in live]
        self._live_set = set(self._live)

    @property
    def reads_in_place(self) -> bool:
        """Whether the writer reads live tensors (so a write must be done when fill returns)."""
        return bool(self._live)

    def fill(self, spec, start: int, end: int, write: Callable[[memoryview], None]) -> None:
        """The writer's callback (background thread): one tensor at a time. A tensor read in
        place is written under the lock, so detach() cannot swap it out half-way; a copy is not."""
        if spec.name not in self._live_set:
            self.contents.fill(spec, start, end, write)
            return
        with self._lock:
            self.contents.fill(spec, start, end, write)
            self._written.add(spec.name)

    def detach(self) -> None:
        """Before the engine's state changes (training thread): copy what is not written yet.
        Waits for the tensor being written only if it is read in place; a no-op after the first
        call, and when everything was copied at the start (state on a GPU). Every optimizer step
        calls this while a save is in flight: it must not wait on the writer's I/O needlessly."""
        if self._detached:  # set by the training thread only, so read here without the lock
            return
        if not self._live:
            self._detached = True
            return
        with self._lock:
            self._detached = True
            rest = [name for name in self._live if name not in self._written]
            held = self.contents.held
            for name, copy in zip(rest, self._lazy.take([held[n].tensor for n in rest])):
                held[name] = Held(copy, held[name].start)
