"""A local output file of known size, filled at any offset through a shared memory map.

Rank-major copying (zeroshard.toolkit.transfer) reads each input file once, front to back, and
drops every fragment at its computed offset in the outputs. A memory map makes each such
placement a memcpy, with no system call per fragment, which is what keeps a 1,000-rank reshard of
tiny tensors from becoming a syscall storm. The file is allocated in full first
(posix_fallocate), so a full disk is an error at open, not a SIGBUS half-way through a copy.

Like AtomicWriter, the file lives under a temp name in the target folder and appears under its
own name only on commit(); several processes may attach to the same temp file and fill disjoint
ranges (parallel workers). Pages are dropped from this process's mapping as they fill (the page
cache keeps them, dirty, until written back), so resident memory stays bounded: by 64 MiB per
thread filling outputs.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading

from zeroshard.errors import InvalidArgumentError
from zeroshard.storage.location import Location, storage_errors
from zeroshard.storage.writeback import WritebackPacer, start_writeback

RELEASE_EVERY_BYTES = 64 * 1024 * 1024


class _Residency(threading.local):
    """Per thread (worker threads fill outputs side by side): the outputs with pages mapped in
    since the last release, and how many bytes."""

    def __init__(self) -> None:
        self.touched: set[MappedOutput] = set()
        self.nbytes = 0


_residency = _Residency()


class MappedOutput:
    """`out = MappedOutput.create(loc, name, size)`; `out.view[a:b] = data`; `out.commit()`."""

    def __init__(self, location: Location, name: str, temp_path: str, size: int):
        if not location.local:
            raise InvalidArgumentError("MappedOutput is for local folders")
        self.location, self.name, self.temp_path, self.size = location, name, temp_path, size
        self.where = location.url_of(name)
        self._map: mmap.mmap | None = None
        self.view = memoryview(b"")
        self._fd: int | None = None  # opened on the first pwrite or writeback
        self._writeback = WritebackPacer()  # [Note: early writeback] in storage/writeback.py

    @classmethod
    def create(cls, location: Location, name: str, size: int) -> "MappedOutput":
        """A new temp file of `size` bytes, allocated on disk, beside `name` in `location`."""
        location.makedirs()
        temp = location.full_path(location.temp_name(name))
        out = cls(location, name, temp, size)
        with storage_errors(out.where):
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                if size:
                    _allocate(fd, size)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
        out._map_fd(fd)
        return out

    @classmethod
    def attach(cls, location: Location, name: str, temp_path: str, size: int) -> "MappedOutput":
        """Map a temp file another process created (a worker filling its share)."""
        out = cls(location, name, temp_path, size)
        with storage_errors(out.where):
            fd = os.open(temp_path, os.O_RDWR)
        out._map_fd(fd)
        return out

    def _map_fd(self, fd: int) -> None:
        try:
            with storage_errors(self.where):
                if self.size:
                    self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_WRITE)
                    # no read-ahead on a fault: the kernel would "read" (zero-fill) a window of
                    # fresh pages around each write through the map, pages that pwrite then fills
                    # again; measured at an eighth of a 3.9 GB reshard's time
                    self._map.madvise(mmap.MADV_RANDOM)
                    self.view = memoryview(self._map)
        finally:
            os.close(fd)  # the map keeps the file; no descriptor held per output

    def pwrite(self, data: memoryview, offset: int) -> None:
        """Write a big piece with a system call: no page faults on this side, no zero-filling of
        fresh pages before they are overwritten (what a memcpy into the map costs)."""
        with storage_errors(self.where):
            fd, due = self._descriptor(), self._writeback.due(len(data))
            while len(data):
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written
            if due:
                start_writeback(fd)

    def _descriptor(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.temp_path, os.O_WRONLY)
        return self._fd

    def wrote(self, nbytes: int) -> None:
        """Account for bytes just written (or read) through the map. The budget is this thread's,
        across all its outputs: past RELEASE_EVERY_BYTES, every output drops its mapped pages. Every
        WRITEBACK_BYTES of this output, its write-out to disk starts ([Note: early writeback])."""
        if self._writeback.due(nbytes):
            with storage_errors(self.where):
                start_writeback(self._descriptor())
        budget = _residency
        budget.touched.add(self)
        budget.nbytes += nbytes
        if budget.nbytes >= RELEASE_EVERY_BYTES:
            for out in budget.touched:
                out.release()
            budget.touched.clear()
            budget.nbytes = 0

    def release(self) -> None:
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)  # shared file pages stay in the page cache, dirty

    def close(self) -> None:
        """Unmap (the data stays in the file); the temp file stays for commit() or discard()."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        _residency.touched.discard(self)
        self.view.release()
        self.view = memoryview(b"")
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    def commit(self) -> None:
        """Move the temp file to its name (durability: Location.fsync before anything vouches for it)."""
        self.close()
        move_into_place(self.location, self.temp_path, self.name)

    def discard(self) -> None:
        self.close()
        with contextlib.suppress(OSError):
            os.unlink(self.temp_path)


def move_into_place(location: Location, temp_path: str, name: str) -> None:
    """Rename a finished temp file (of this process or a worker's) to `name` in `location`."""
    with storage_errors(location.url_of(name)):
        os.replace(temp_path, location.full_path(name))


def _allocate(fd: int, size: int) -> None:
    """Reserve `size` bytes on disk, so writing through the map cannot fail for lack of space."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a filesystem without fallocate: best effort


