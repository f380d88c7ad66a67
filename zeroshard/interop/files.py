"""How the interop readers reach a foreign checkpoint's files: only through storage's Location,
so SRC may be a local folder or any URL fsspec reads (s3://).

Paths stay strings joined with "/" (a local path or a URL), so every error names the file as the
user would (its URL on S3). Locally the old refusals hold: a link leading out of the checkpoint
folder, a FIFO (which would hang the read), a device or a folder is refused by name. Object
stores have no links, FIFOs or devices.

The storage options of the command (an S3 endpoint, credentials) apply to every file read
inside `with storage_options(...)`: the readers pass paths, not Locations, down their calls.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import posixpath
from typing import Any, Callable, Iterator, Mapping

from zeroshard.errors import CheckpointError, StorageError
from zeroshard.storage.location import Location, RangeReader, local_path

_OPTIONS: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("zeroshard_interop_options", default={})


@contextlib.contextmanager
def storage_options(options: Mapping[str, Any] | None) -> Iterator[None]:
    """Files opened inside the block are opened with these fsspec/zeroshard storage options."""
    token = _OPTIONS.set(dict(options or {}))
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def options() -> dict[str, Any]:
    """The storage options in force (for a reader that builds its own Location)."""
    return dict(_OPTIONS.get())


def bound(read: Callable[..., Any]) -> Callable[..., Any]:
    """`read`, run later (a LazyTensor's read, after the reader returned) with the storage
    options in force now."""
    options = _OPTIONS.get()

    def run(*args: Any) -> Any:
        with storage_options(options):
            return read(*args)

    return run


def is_local(path: str) -> bool:
    return local_path(os.fspath(path)) is not None


def join(folder: str, *names: str) -> str:
    return posixpath.join(folder, *names)


def absolute(path: str) -> str:
    """The absolute form of a local path; a URL as it is."""
    return os.path.abspath(path) if is_local(path) else path.rstrip("/")


def parent(path: str) -> str:
    """The folder holding `path` (for a relative local path, resolved first)."""
    return posixpath.dirname(absolute(path))


def _split(path: str) -> tuple[Location, str]:
    path = path.rstrip("/") or path
    folder, name = posixpath.split(path)
    try:
        return Location(folder or ".", _OPTIONS.get()), name
    except StorageError as exc:
        raise CheckpointError(path, exc.problem) from None


def folder(path: str) -> Location:
    try:
        return Location(path, _OPTIONS.get())
    except StorageError as exc:
        raise CheckpointError(path, exc.problem) from None


# ---- queries (a StorageError, say a lost network, becomes a CheckpointError naming the file) -------
@contextlib.contextmanager
def _named(path: str) -> Iterator[None]:
    try:
        yield
    except StorageError as exc:
        raise CheckpointError(exc.where or path, exc.problem) from None


def isdir(path: str) -> bool:
    with _named(path):
        return folder(path).isdir()  # asked of the folder itself: a bucket's root has no parent


def exists(path: str) -> bool:
    """Whether anything (a link too, locally) is at `path`."""
    loc, name = _split(path)
    with _named(path):
        return loc.exists(name)


def isfile(path: str) -> bool:
    """Whether `path` is a file (locally: following links, as os.path.isfile)."""
    loc, name = _split(path)
    with _named(path):
        if loc.local:
            return os.path.isfile(loc.full_path(name))
        return loc.exists(name) and not loc.isdir(name)


def islink(path: str) -> bool:
    loc, name = _split(path)
    return loc.is_link(name)


def listdir(path: str) -> list[str]:
    """Names directly inside folder `path` (sorted)."""
    with _named(path):
        return folder(path).list()


# ---- reading --------------------------------------------------------------------------------
def _inside(path: str, root: str) -> str:
    """The path to open: locally, `path` resolved, which must stay inside `root`."""
    if not is_local(path):
        return path
    real, top = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, top]) != top:
        raise CheckpointError(path, f"is a link leading out of the checkpoint folder (to {real})")
    return real


def open_inside(path: str, root: str) -> tuple[RangeReader, int]:
    """(ranged reader, size) of the regular file at `path`, which must lie inside `root`: a link
    leading out of it, a FIFO, a device or a folder is refused with an error naming `path`."""
    loc, name = _split(_inside(path, root))
    try:
        if not loc.local:  # one HEAD: its size also spares the read-ahead asking for it
            size = loc.size(name)
            return loc.open_reader(name, size=size), size
        reader = loc.open_reader(name)  # locally opened first: a FIFO is refused before any stat
        try:
            return reader, loc.size(name)
        except BaseException:
            reader.close()
            raise
    except StorageError as exc:
        raise CheckpointError(path, exc.problem) from None


def size_inside(path: str, root: str) -> int:
    """The size of regular file `path` inside `root` (checked as open_inside does)."""
    reader, size = open_inside(path, root)
    reader.close()
    return size


def read_inside(path: str, root: str, limit: int | None = None, what: str = "such a file") -> bytes:
    """The whole of regular file `path` inside `root`; refused if larger than `limit` bytes."""
    reader, size = open_inside(path, root)
    with reader:
        if limit is not None and size > limit:
            raise CheckpointError(path, f"is {size} bytes, more than the {limit} {what} can hold")
        return read_range(reader, path, 0, size)


def read_range(reader: RangeReader, path: str, offset: int, length: int) -> bytes:
    """Exactly `length` bytes at `offset` of an open file; a short file is an error naming `path`."""
    try:
        return reader.read(offset, length)
    except StorageError as exc:
        problem = exc.problem
        if "truncated" in problem:
            problem = f"file ends before byte {offset + length}"
        raise CheckpointError(path, problem) from None


def read_small(path: str, limit: int) -> bytes:
    """The whole of a small regular file (a link followed, as a `latest` file may be one)."""
    loc, name = _split(path)
    try:
        with loc.open_reader(name, follow_links=True) as reader:
            size = loc.size(name)
            if size > limit:
                raise CheckpointError(path, f"is {size} bytes, more than the {limit} such a file can hold")
            return read_range(reader, path, 0, size)
    except StorageError as exc:
        raise CheckpointError(path, exc.problem) from None
