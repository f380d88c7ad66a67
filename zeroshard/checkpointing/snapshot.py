"""Async saves: a copy of the rank's state, taken while training waits, written in the background.

The copy is all that training waits for, so it is made fast:
- its buffers are kept from save to save (allocating, and first touching, fresh memory costs
  several times the copy itself; safe because a save always waits for the previous one first);
- on CUDA they are pinned, and the device-to-host copies are asynchronous, synchronized once;
- on the CPU the bytes are cut into chunks of a few MiB copied by a small thread pool (torch's
  copy releases the GIL), so the copy runs at the memory bandwidth of several cores, not one.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

CHUNK_BYTES = 4 << 20


class Snapshot:
    """Reusable host copies of a list of 1-D tensors (the buffers follow the tensors' sizes)."""

    def __init__(self, threads: int | None = None) -> None:
        self.buffers: list[torch.Tensor] = []
        self.threads = threads or min(8, max(1, (os.cpu_count() or 1)))
        self._pool: ThreadPoolExecutor | None = None

    def take(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` (1-D), valid until the next take()."""
        cuda = any(t.device.type == "cuda" for t in tensors)
        out = []
        for i, t in enumerate(tensors):
            if i >= len(self.buffers):
                self.buffers.append(torch.empty(0, dtype=torch.uint8))
            buf = self.buffers[i]
            nbytes = t.numel() * t.element_size()
            if buf.numel() != nbytes:
                buf = self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
            out.append(buf.view(t.dtype) if nbytes else torch.empty(0, dtype=t.dtype))
        del self.buffers[len(tensors):]
        if cuda:
            for dst, src in zip(out, tensors):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
        else:
            self._copy_parallel(out, tensors)
        return out

    def _copy_parallel(self, out: list[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
        jobs = []
        for dst, src in zip(out, tensors):
            step = max(1, CHUNK_BYTES // max(1, src.element_size()))
            for begin in range(0, src.numel(), step):
                jobs.append((dst[begin: begin + step], src[begin: begin + step]))
        if self.threads == 1 or len(jobs) < 2:
            for dst, src in jobs:
                dst.copy_(src)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="zeroshard-snapshot")
        for future in [self._pool.submit(dst.copy_, src) for dst, src in jobs]:
            future.result()
