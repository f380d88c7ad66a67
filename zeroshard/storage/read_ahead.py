"""Concurrent ranged GETs for remote files: read-ahead while a file is read in order, and an
ordered fetch of a known list of ranges across many files.

One GET stream from S3 runs at a fraction of what the link and the service can give; several
in flight at once fill it. Two ways in:

- BlockReader (behind RangeReader for remote files, so callers change nothing): a read larger
  than a block is split into block GETs that run together; once reads continue where the last
  one ended, the next blocks are fetched ahead. The window grows with the sequential run (never
  more blocks ahead than bytes already read in order, nor more than `read_ahead`), so a reader
  that jumps about wastes little: a random read of one block or less is one exact GET.
- read_ranges: a caller that knows all its reads up front gets their bytes in order while the
  next ones are fetched, across files, with requests and bytes in flight bounded.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol

from zeroshard.errors import StorageError
from zeroshard.storage.describe import describe_error
from zeroshard.storage.remote_io import BlockBudget, RemoteIO, submit


class Folder(Protocol):
    """What these readers need of a folder (storage.location.Location has it), so that this
    module does not import location.py, which imports it."""

    local: bool
    fs: Any
    remote_io: RemoteIO
    read_budget: BlockBudget

    def url_of(self, name: str) -> str: ...

    def full_path(self, name: str) -> str: ...

    def size(self, name: str) -> int: ...

    def open_reader(self, name: str) -> Any: ...


@dataclass
class _Block:
    start: int
    end: int  # as asked; the data is shorter only at the end of the file
    future: Future
    ahead: bool  # holds a token of the location's read-ahead budget


class BlockReader:
    """Reads of one remote file through concurrent block GETs (see the module docstring).

    At most `settings.read_ahead` GETs of this reader are in flight or held at any time, and
    read-ahead blocks also count against `budget`, shared by the readers of one Location.
    A failed GET surfaces as a StorageError naming `where` at the read that needs its bytes.
    """

    def __init__(self, location: Folder, name: str, settings: RemoteIO, budget: BlockBudget,
                 size: int | None = None):
        self.where = location.url_of(name)
        self._location, self._name, self._path = location, name, location.full_path(name)
        self._block, self._depth, self._budget = settings.block_bytes, settings.read_ahead, budget
        self._size = size
        self._blocks: dict[int, _Block] = {}  # block index -> a GET in flight or its bytes
        self._last_end = -1  # where the previous read ended
        self._run = 0  # bytes read in order up to _last_end

    # ---- reading --------------------------------------------------------------------------
    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Fill `buffer` from `offset`; returns how many bytes there were (short at the file end)."""
        want = len(buffer)
        end = offset + want
        if want == 0:
            return 0
        sequential = offset == self._last_end
        for index in [i for i, b in self._blocks.items() if b.end <= offset or (not sequential and b.start >= end)]:
            self._drop(index)  # behind us, or ahead of a reader that jumped: not needed any more
        self._run = self._run + want if sequential else want
        self._last_end = end
        if not self._blocks and want <= self._block and (not sequential or self._run <= self._block):
            # a random read, or the start of a run (a header, say): one exact GET, nothing ahead
            return self._read_exact(offset, buffer)
        # blocks ahead of this read: no more than bytes already read in order (little waste when
        # the run stops soon), no more than the reader's depth
        ahead = min(self._depth, -(-self._run // self._block) - 1) if sequential else 0
        last = (end - 1) // self._block
        pos = offset
        while pos < end:
            index = pos // self._block
            self._schedule(pos, end, last, last + ahead, clip=not sequential)
            block = self._blocks[index]
            data = self._result(index, block)
            stop = min(end, block.start + len(data))
            buffer[pos - offset:stop - offset] = memoryview(data)[pos - block.start:stop - block.start]
            pos = stop
            short = len(data) < block.end - block.start
            if short or pos >= block.end:
                self._drop(index)
            if short:  # the end of the file
                break
        return pos - offset

    def _read_exact(self, offset: int, buffer: memoryview) -> int:
        future = submit(self._location.fs, "cat_file", self._path, start=offset, end=offset + len(buffer))
        data = _wait(future, self.where)
        buffer[:len(data)] = data
        return len(data)

    def _schedule(self, pos: int, end: int, last: int, ahead_to: int, clip: bool) -> None:
        """Have the blocks from `pos` up to block `ahead_to` in flight, in order, within the bounds.

        Blocks up to `last` are needed by the current read; with clip (a read out of order) the
        last of them stops at `end`, so nothing past the read is fetched."""
        first = pos // self._block
        block = self._blocks.get(first)
        if block is not None and not block.start <= pos < block.end:
            self._drop(first)  # an earlier read fetched only part of this block
        for index in range(first, ahead_to + 1):
            if index in self._blocks:
                continue
            start = pos if index == first else index * self._block
            stop = (index + 1) * self._block
            if clip and index == last:
                stop = min(stop, end)
            read_ahead = index > last
            if read_ahead:
                stop = min(stop, self._file_size())
                if start >= stop or len(self._blocks) >= self._depth or not self._budget.take():
                    return
            elif len(self._blocks) >= self._depth:
                if index != first:
                    return  # the read's later blocks go out as its earlier ones are used up
                self._drop(max(self._blocks))  # room for the block this read waits on now
            future = submit(self._location.fs, "cat_file", self._path, start=start, end=stop)
            self._blocks[index] = _Block(start, stop, future, read_ahead)

    def _result(self, index: int, block: _Block) -> bytes:
        try:
            return _wait(block.future, self.where)
        except BaseException:
            self._drop(index)
            raise

    def _file_size(self) -> int:
        if self._size is None:
            self._size = self._location.size(self._name)
        return self._size

    def _drop(self, index: int) -> None:
        block = self._blocks.pop(index)
        block.future.cancel()
        if block.ahead:
            self._budget.give()

    def in_flight(self) -> int:
        """GETs of this reader not finished yet (for tests and diagnostics)."""
        return sum(not b.future.done() for b in self._blocks.values())

    def close(self) -> None:
        """Cancel every GET in flight and let go of the blocks held."""
        for index in list(self._blocks):
            self._drop(index)


def _wait(future: Future, where: str) -> bytes:
    try:
        return future.result()
    except StorageError:
        raise
    except Exception as exc:  # whatever the client raised becomes one line naming the URL
        raise StorageError(where, describe_error(exc)) from exc


def read_ranges(location: Folder, ranges: Iterable[tuple[str, int, int]], *,
                max_bytes: int | None = None, max_requests: int | None = None) -> Iterator[bytes]:
    """Yield the bytes of each `(name, offset, length)` in `ranges`, in the order given.

    On a remote location the following ranges are fetched while the caller works on the current
    one: ranges larger than a block are split into block GETs, at most `max_requests` GETs
    (default: the location's read_ahead) and `max_bytes` of data (default read_ahead x block
    size, or one range if larger) are in flight or waiting at once, across all the files named.
    A failed or short read raises a StorageError naming the file when its turn comes. Closing
    the generator early cancels what is in flight. Locally, ranges are read one by one.
    """
    ranges = [(name, int(offset), int(length)) for name, offset, length in ranges]
    if location.local:
        yield from _read_local(location, ranges)
        return
    settings = location.remote_io
    block = settings.block_bytes
    max_requests = max_requests or settings.read_ahead
    max_bytes = max_bytes or settings.read_ahead * block
    pieces = ((i, name, start, min(start + block, offset + length))
              for i, (name, offset, length) in enumerate(ranges) for start in range(offset, offset + length, block))
    in_flight: deque[tuple[int, int, int, Future]] = deque()  # (range index, start, end, GET)
    held = 0
    upcoming = next(pieces, None)

    def top_up() -> None:
        nonlocal held, upcoming
        while upcoming is not None and (not in_flight or (len(in_flight) < max_requests
                                                           and held + upcoming[3] - upcoming[2] <= max_bytes)):
            i, name, start, end = upcoming
            in_flight.append((i, start, end,
                              submit(location.fs, "cat_file", location.full_path(name), start=start, end=end)))
            held += end - start
            upcoming = next(pieces, None)

    try:
        for name, offset, length in ranges:
            parts: list[bytes] = []
            while sum(map(len, parts)) < length:
                top_up()
                _, start, end, future = in_flight.popleft()
                data = _wait(future, location.url_of(name))
                held -= end - start
                if len(data) != end - start:
                    raise StorageError(location.url_of(name), f"file is truncated: wanted bytes [{offset}, "
                                                              f"{offset + length}), got {start - offset + len(data)}")
                parts.append(data)
            top_up()  # keep the next GETs going while the caller works on this range
            yield parts[0] if len(parts) == 1 else b"".join(parts)  # b"" for an empty range
    finally:
        for *_, future in in_flight:
            future.cancel()


def _read_local(location: Folder, ranges: list[tuple[str, int, int]]) -> Iterator[bytes]:
    readers = {}
    try:
        for name, offset, length in ranges:
            if name not in readers:
                readers[name] = location.open_reader(name)
            yield readers[name].read(offset, length)
    finally:
        for reader in readers.values():
            reader.close()

