"""Device tensors to and from checkpoint bytes through two reused pinned host windows.

Why: a CUDA tensor's bytes reach a file through host memory. Copying each tensor to a new
pageable host tensor (`.to("cpu")`, or a read into `torch.empty` then `.to(device)`) pays a page
fault for every fresh host page and a staged pageable copy for every byte: on an H100 a 124M
model's load spent 0.18 s in `.to` and its reads ran at half the speed of reads into warm
memory (docs/BENCHMARKS.md, GPU section). Two pinned windows, allocated once per save or load
and reused, make every copy a direct DMA, and on load the copy of one window runs while the
next is read.

Windows alternate, so the one handed out before the current one stays untouched: what a
write-behind writer needs (storage.AtomicWriter: a write's data must not change until the next
write; pieces too small for a window are fresh copies, see `windows`), what an asynchronous
host-to-device copy needs before its window is read into again (each window's copy is waited
for first), and what a reader hashing behind needs (each window's hashing is waited for
first: CheckpointReader(hash_behind=True)).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from zeroshard.storage.stream_writer import SMALL_WRITE_BYTES

WINDOW_BYTES = 16 << 20


class Staging:
    """Two host windows of at most `window_bytes`, pinned when `device` is a CUDA device."""

    def __init__(self, device: torch.device | str, window_bytes: int = WINDOW_BYTES) -> None:
        self.device = torch.device(device)
        self.window_bytes = window_bytes
        self._pinned = self.device.type == "cuda"
        self._windows: list[torch.Tensor | None] = [None, None]
        self._copies: list[Any] = [None, None]  # the CUDA event of each window's last device copy
        self._marks = [0, 0]  # the reader's hash mark after each window's last read (hash behind)
        self._turn = 0

    def _window(self, nbytes: int) -> torch.Tensor:
        self._turn ^= 1
        i = self._turn
        if self._copies[i] is not None:
            self._copies[i].synchronize()  # its previous copy to the device must have read it
            self._copies[i] = None
        window = self._windows[i]
        if window is None or window.numel() < nbytes:
            window = self._windows[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)
        return window[:nbytes]

    def read(self, reader: Any, entry: Any, start: int, target: torch.Tensor) -> None:
        """Fill the contiguous 1-D `target` (the entry's dtype, on any device) with the entry's
        elements [start, start + target.numel()) read by `reader` (a CheckpointReader): window by
        window, front to back, so the reader still checks each fragment's hash."""
        raw = target.view(torch.uint8)
        size = entry.itemsize
        step = max(size, self.window_bytes // size * size)
        for at in range(0, raw.numel(), step):
            n = min(step, raw.numel() - at)
            window = self._window(n)
            reader.settle(self._marks[self._turn])  # its last bytes hashed before they are overwritten
            reader.read_into(entry, start + at // size, memoryview(window.numpy()), until=start + raw.numel() // size)
            self._marks[self._turn] = reader.hash_mark()
            raw[at:at + n].copy_(window, non_blocking=self._pinned)
            if self._pinned:
                event = torch.cuda.Event()
                event.record()
                self._copies[self._turn] = event

    def windows(self, tensor: torch.Tensor) -> Iterator[memoryview]:
        """The bytes of `tensor` (on any device) in order, a window at a time; each stays valid
        until the one after the next is produced.

        A piece under SMALL_WRITE_BYTES skips the windows (a device tensor's piece comes as a
        fresh host copy, a host tensor's as its own bytes): the stream writer gathers such writes
        rather than sending them, so they do not finish the write in flight, and a window reused
        after one could change under that write. See [Note: write-behind buffers]
        (storage/stream_writer.py)."""
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        for at in range(0, raw.numel(), self.window_bytes):
            n = min(self.window_bytes, raw.numel() - at)
            if n < SMALL_WRITE_BYTES:
                yield memoryview(raw[at:at + n].cpu().numpy())
                continue
            window = self._window(n)
            window.copy_(raw[at:at + n])  # synchronous: the bytes are there when this returns
            yield memoryview(window.numpy())

    def finish(self) -> None:
        """Wait for the copies still in flight (the targets are then complete for any stream)."""
        for i, event in enumerate(self._copies):
            if event is not None:
                event.synchronize()
                self._copies[i] = None
