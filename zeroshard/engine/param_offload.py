"""offload_param (stage 3): where the parameter partitions that the unit gathers read live.

Without it the gathers read this rank's fp32 master chunks and cast them (ResidentTier): the
master is the partition. With `zero_optimization.offload_param` a separate compute-dtype
partition (the `chunk` elements this rank owns of every parameter) is kept in a tier, written
from the masters after every optimizer step (and after loads), and copied into each unit's
all-gather input by the same gather, prefetched or not, that stage3.py issues:

  device: cpu   HostTier: one flat host buffer (page-locked with pin_memory on CUDA, so the copy
                into the device's gather buffer is asynchronous). On a CPU-only machine the
                "device" is the host too: the buffer is still separate, so the path is the same.
  device: nvme  NvmeTier: a file per rank under nvme_path, each unit's partitions in one run of
                4 KiB-aligned regions, read and written on background threads with large aligned
                I/O (O_DIRECT where the filesystem takes it, plain buffered I/O otherwise) through
                buffer_count staging buffers of at most buffer_size elements. Stage 3 reads the
                next units of the recorded order ahead of their gathers (read_ahead).

Checkpoints read and write the masters only, so they do not change with the tier.
A tier is chosen once, at initialize (`choose_tier`); the engine calls `update()` whenever the
masters change.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import os
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import torch

from zeroshard.engine.layout import ParamShard
from zeroshard.errors import ConfigError, StorageError

ALIGN = 4096  # O_DIRECT needs block-aligned addresses, offsets and lengths; 4 KiB fits every common disk
PARAM_OFFLOAD_KEYS = frozenset({"device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"})


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class ResidentTier:
    """No parameter offload: the gathers read (and cast) the fp32 masters."""

    kind = "none"
    depth = 0  # units read ahead

    def fill(self, unit: int, shards: Sequence[ParamShard], targets: Sequence[torch.Tensor]) -> None:
        for s, t in zip(shards, targets):
            # From pinned host memory (offload_optimizer) this is asynchronous, ordered before the collective.
            t.copy_(s.master, non_blocking=s.master.is_pinned())

    def read_ahead(self, units: Sequence[int]) -> None:
        pass

    def update(self) -> None:
        pass

    def report(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class HostTier(ResidentTier):
    """Partitions in one flat host buffer (the CUDA path: pinned memory, asynchronous copies up)."""

    kind = "cpu"

    def __init__(self, shards: Sequence[ParamShard], dtype: torch.dtype, device: torch.device, pin: bool) -> None:
        self.shards, self.device = list(shards), device
        self.pin = pin and device.type == "cuda"
        self.buffer = torch.empty(sum(s.chunk for s in self.shards), dtype=dtype, pin_memory=self.pin)
        self.views: dict[int, torch.Tensor] = {}
        offset = 0
        for s in self.shards:
            self.views[s.index] = self.buffer[offset: offset + s.chunk]
            offset += s.chunk
        self.stats = {"updates": 0, "bytes_up": 0}

    def fill(self, unit: int, shards: Sequence[ParamShard], targets: Sequence[torch.Tensor]) -> None:
        for s, t in zip(shards, targets):
            t.copy_(self.views[s.index], non_blocking=self.pin)
            self.stats["bytes_up"] += t.numel() * t.element_size()

    def update(self) -> None:
        if self.pin:  # a copy up from the buffer may still be queued on the stream
            torch.cuda.current_stream(self.device).synchronize()
        with torch.no_grad():
            for s in self.shards:
                self.views[s.index].copy_(s.master)
        self.stats["updates"] += 1

    def report(self) -> dict[str, int]:
        return {"param_offload_host": self.buffer.numel() * self.buffer.element_size()}


def _aligned(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host tensor whose data starts on an ALIGN boundary (O_DIRECT needs it)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip: skip + nbytes]  # the view keeps `raw` alive


def _memory(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 host tensor, for os.preadv/pwritev (no copy)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B")


def _io(op: Any, fd: int, view: memoryview, offset: int, path: str) -> None:
    """Read or write all of `view` at `offset` (a failure: one StorageError naming the file)."""
    what = "read" if op is os.preadv else "write"
    done = 0
    while done < len(view):
        try:
            n = op(fd, [view[done:]], offset + done)
        except OSError as e:
            raise StorageError(path, f"offload_param {what} of {len(view) - done} bytes at offset "
                                     f"{offset + done} failed: {e.strerror or e}") from e
        if n <= 0:
            raise StorageError(path, f"offload_param {what} stopped short at offset {offset + done} "
                                     f"({errno.errorcode.get(errno.EIO)}: file truncated?)")
        done += n


def _close_file(pool: cf.ThreadPoolExecutor, fd: int, path: str) -> None:
    pool.shutdown(wait=True)
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class NvmeTier(ResidentTier):
    """Partitions in a file under nvme_path, staged through buffer_count aligned host buffers."""

    kind = "nvme"

    def __init__(self, units: Sequence[Sequence[ParamShard]], dtype: torch.dtype, device: torch.device,
                 spec: Mapping[str, Any], rank: int, unit_names: Sequence[str] = ()) -> None:
        self.units = [list(u) for u in units]
        self.dtype, self.device = dtype, device
        self.elem = torch.empty((), dtype=dtype).element_size()
        self.pin = bool(spec.get("pin_memory", True)) and device.type == "cuda"
        self.count = int(spec.get("buffer_count", 5))
        cap = int(spec.get("buffer_size", 100_000_000)) * self.elem
        # File layout: each shard's region (ALIGN-padded) at its first unit, so a unit is one run.
        self.offset: dict[int, int] = {}
        self.group: dict[int, int] = {}  # shard index -> the unit whose write covers it
        size = 0
        for u, shards in enumerate(self.units):
            for s in shards:
                if s.index not in self.offset:
                    self.offset[s.index], self.group[s.index] = size, u
                    size += _round_up(s.chunk * self.elem)
        self.size = size
        self.plans = [self._plan(shards) for shards in self.units]
        need = max([p[2] for p in self.plans] + [ALIGN])
        if need > _round_up(cap):
            u = max(range(len(self.plans)), key=lambda i: self.plans[i][2])
            name = unit_names[u] if u < len(unit_names) else f"#{u}"
            raise ConfigError(f"zero_optimization.offload_param.buffer_size={cap // self.elem} elements is smaller "
                              f"than stage-3 unit {name!r} ({need // self.elem} elements with alignment): raise "
                              "buffer_size or use smaller units (stage3_unit_classes)")
        self.path = os.path.join(str(spec["nvme_path"]), f"zeroshard-params-rank{rank}-pid{os.getpid()}.swp")
        self.fd, self.direct = self._open()
        # Staging buffers, sized to the largest unit (buffer_size is the cap, not an allocation).
        self.free = [_aligned(need, self.pin) for _ in range(self.count)]
        self.staging_bytes = need * self.count
        self.cond = threading.Condition()
        self.copies: dict[int, Any] = {}  # staging buffer -> CUDA event of the last copy up from it
        self.pool = cf.ThreadPoolExecutor(max_workers=max(1, min(4, self.count)), thread_name_prefix="zs-nvme")
        self._finalizer = weakref.finalize(self, _close_file, self.pool, self.fd, self.path)
        self.reads: dict[int, cf.Future] = {}  # unit -> staging buffer being / already read
        self.writes: dict[int, cf.Future] = {}  # write group -> pending write
        self.depth = max(0, self.count - 1)  # one buffer always left for a demand read
        self.stats = {"reads": 0, "read_ahead_hits": 0, "bytes_read": 0, "bytes_written": 0,
                      "read_s": 0.0, "write_s": 0.0}
        os.ftruncate(self.fd, self.size)

    def _plan(self, shards: Sequence[ParamShard]) -> tuple[list[tuple[int, int, int]], dict[int, int], int]:
        """(runs as (file offset, bytes, staging offset), staging offset per shard, staging bytes)."""
        runs: list[tuple[int, int, int]] = []
        where: dict[int, int] = {}
        pos = 0
        for index in sorted({s.index for s in shards}, key=lambda i: self.offset[i]):
            region = _round_up(next(s for s in shards if s.index == index).chunk * self.elem)
            where[index] = pos
            if region:
                if runs and runs[-1][0] + runs[-1][1] == self.offset[index]:
                    f, n, p = runs[-1]
                    runs[-1] = (f, n + region, p)
                else:
                    runs.append((self.offset[index], region, pos))
            pos += region
        return runs, where, pos

    def _open(self) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        direct = getattr(os, "O_DIRECT", 0)
        if direct:
            try:
                fd = os.open(self.path, flags | direct, 0o600)
            except OSError:
                fd = -1
            if fd >= 0:
                try:  # some filesystems accept the flag at open and refuse the I/O
                    probe = _aligned(ALIGN, False)
                    _io(os.pwritev, fd, _memory(probe), 0, self.path)
                    _io(os.preadv, fd, _memory(probe), 0, self.path)
                    return fd, True
                except StorageError:
                    os.close(fd)
        try:
            return os.open(self.path, flags, 0o600), False
        except OSError as e:
            raise StorageError(self.path, f"offload_param cannot create its file: {e.strerror or e}") from e

    # -- staging buffers ------------------------------------------------------------------

    def _take(self) -> torch.Tensor:
        with self.cond:
            while not self.free:
                self.cond.wait()
            buf = self.free.pop()
            copied = self.copies.pop(buf.data_ptr(), None)
        if copied is not None:  # an asynchronous copy up from it may still be running
            copied.synchronize()
        return buf

    def _give(self, buf: torch.Tensor, copied: Any = None) -> None:
        with self.cond:
            if copied is not None:
                self.copies[buf.data_ptr()] = copied
            self.free.append(buf)
            self.cond.notify()

    # -- I/O on the pool's threads ----------------------------------------------------------

    def _read(self, unit: int, after: list[cf.Future]) -> torch.Tensor:
        for w in after:  # queued before this read: already running or done, never waiting on us
            w.result()
        buf = self._take()
        try:
            t0 = _now()
            for file_off, nbytes, pos in self.plans[unit][0]:
                _io(os.preadv, self.fd, _memory(buf[pos: pos + nbytes]), file_off, self.path)
            with self.cond:
                self.stats["bytes_read"] += sum(r[1] for r in self.plans[unit][0])
                self.stats["read_s"] += _now() - t0
        except BaseException:
            self._give(buf)
            raise
        return buf

    def _write(self, shards: Sequence[ParamShard]) -> None:
        buf = self._take()
        try:
            t0 = _now()
            pos, runs = 0, []
            with torch.no_grad():
                for s in shards:
                    region = _round_up(s.chunk * self.elem)
                    if region:
                        buf[pos: pos + s.chunk * self.elem].view(self.dtype).copy_(s.master)
                        runs.append((self.offset[s.index], region, pos))
                    pos += region
            if runs:  # a write group's regions are consecutive in the file: one large write
                _io(os.pwritev, self.fd, _memory(buf[: pos]), runs[0][0], self.path)
            with self.cond:
                self.stats["bytes_written"] += pos
                self.stats["write_s"] += _now() - t0
        finally:
            self._give(buf)

    # -- the tier interface ---------------------------------------------------------------------

    def _submit_read(self, unit: int) -> cf.Future:
        after = [self.writes[g] for g in {self.group[s.index] for s in self.units[unit]} if g in self.writes]
        return self.pool.submit(self._read, unit, after)

    def read_ahead(self, units: Sequence[int]) -> None:
        for u in units[: self.depth]:
            if u not in self.reads and len(self.reads) < self.depth:
                self.reads[u] = self._submit_read(u)

    def fill(self, unit: int, shards: Sequence[ParamShard], targets: Sequence[torch.Tensor]) -> None:
        future = self.reads.pop(unit, None)
        if future is None:
            future = self._submit_read(unit)
        else:
            self.stats["read_ahead_hits"] += 1
        self.stats["reads"] += 1
        buf = future.result()
        where = self.plans[unit][1]
        copied = None
        try:
            for s, t in zip(shards, targets):
                if s.chunk:
                    pos = where[s.index]
                    t.copy_(buf[pos: pos + s.chunk * self.elem].view(self.dtype), non_blocking=self.pin)
            if self.pin:  # the buffer is reused only once these copies are done (not the whole stream)
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(self.device))
        finally:
            self._give(buf, copied)

    def update(self) -> None:
        """The masters changed: drop read-ahead data, write every partition (in the background)."""
        self._drain_reads()
        for w in self.writes.values():
            w.result()
        groups: dict[int, list[ParamShard]] = {}
        for u, shards in enumerate(self.units):
            mine = [s for s in dict.fromkeys(shards) if self.group[s.index] == u]
            mine.sort(key=lambda s: self.offset[s.index])
            if mine:
                groups[u] = mine
        self.writes = {u: self.pool.submit(self._write, mine) for u, mine in groups.items()}

    def _drain_reads(self) -> None:
        for future in self.reads.values():
            try:
                self._give(future.result())
            except StorageError:
                pass  # the demand read will raise it again
        self.reads.clear()

    def flush(self) -> None:
        """Wait for every pending write (tests, benchmarks)."""
        for w in self.writes.values():
            w.result()

    def report(self) -> dict[str, int]:
        return {"param_offload_nvme": self.size,
                "param_offload_staging": self.staging_bytes}

    def close(self) -> None:
        self._drain_reads()
        self.flush()
        self._finalizer()


_now = time.perf_counter


def check_spec(spec: Mapping[str, Any] | None, stage: int) -> None:
    """Config-time checks of zero_optimization.offload_param (no filesystem access)."""
    spec = spec or {}
    unknown = sorted(set(spec) - PARAM_OFFLOAD_KEYS)
    if unknown:
        raise ConfigError(f"unknown config key 'zero_optimization.offload_param.{unknown[0]}' "
                          f"(known: {', '.join(sorted(PARAM_OFFLOAD_KEYS))})")
    device = spec.get("device", "none")
    if device not in (None, "none", "cpu", "nvme"):
        raise ConfigError(f"zero_optimization.offload_param.device={device!r}: use 'cpu', 'nvme' or 'none'")
    if device in (None, "none"):
        return
    if stage != 3:
        raise ConfigError(f"zero_optimization.offload_param needs stage 3 (stage is {stage}): only stage 3 "
                          "partitions the parameters")
    if not isinstance(spec.get("pin_memory", True), bool):
        raise ConfigError("zero_optimization.offload_param.pin_memory must be true or false")
    for key in ("buffer_count", "buffer_size", "max_in_cpu"):
        value = spec.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
            raise ConfigError(f"zero_optimization.offload_param.{key} must be an integer >= 1, got {value!r}")
    if device == "nvme" and not isinstance(spec.get("nvme_path"), (str, os.PathLike)):
        raise ConfigError("zero_optimization.offload_param.device='nvme' needs nvme_path (a directory)")


def check_path(spec: Mapping[str, Any] | None) -> None:
    """initialize-time check (before any collective): nvme_path is a writable directory."""
    spec = spec or {}
    if spec.get("device") != "nvme":
        return
    path = os.fspath(spec["nvme_path"])
    if not os.path.isdir(path):
        raise ConfigError(f"zero_optimization.offload_param.nvme_path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"zero_optimization.offload_param.nvme_path {path!r} is not writable")


def choose_tier(spec: Mapping[str, Any] | None, stage3: Any, dtype: torch.dtype, device: torch.device,
                rank: int) -> ResidentTier:
    """The tier for this run (ResidentTier unless offload_param is on); installed into stage3."""
    device_kind = (spec or {}).get("device", "none")
    if stage3 is None or device_kind in (None, "none"):
        tier: ResidentTier = ResidentTier()
    elif device_kind == "cpu":
        shards = list(dict.fromkeys(s for u in stage3.units for s in u.shards))
        tier = HostTier(shards, dtype, device, bool(spec.get("pin_memory", True)))
    else:
        tier = NvmeTier([u.shards for u in stage3.units], dtype, device, spec, rank,
                        [u.name for u in stage3.units])
    if stage3 is not None:
        stage3.tier = tier
    tier.update()
    return tier
