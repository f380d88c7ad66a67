"""A folder on local disk or S3, reached through fsspec, with ranged reads and atomic writes.

Everything above this module speaks in names relative to a folder; this module alone knows
about fsspec, file handles, temp names and multipart uploads. Every failure below is turned
into a StorageError that names the URL.

Atomic writes: locally a file is written under a temp name in the same folder, fsynced, and
renamed into place; on S3 a multipart upload is completed only on success and aborted on
failure, so an object never appears half-written.

Remote reads and S3 writes run several requests at once (read_ahead.py, multipart.py), sized by
the `zeroshard_*` storage options (remote_io.py); on s3:// a failing request is retried for at
most `zeroshard_retry_s` seconds (s3_retry.py), so a lost network ends a command in bounded time.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import posixpath
import stat
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from zeroshard.errors import InvalidArgumentError, StorageError
from zeroshard.storage.describe import describe_error
from zeroshard.storage.owner import owner_tag
from zeroshard.storage.remote_io import BlockBudget, split_options
from zeroshard.storage.writeback import WritebackPacer, start_writeback

if TYPE_CHECKING:  # remote-only machinery is imported where used: a local command starts faster
    from concurrent.futures import Future, ThreadPoolExecutor

    from zeroshard.storage.read_ahead import BlockReader

TEMP_PREFIX = ".zeroshard-tmp-"


def is_temp_name(name: str) -> bool:
    """Whether `name` is a temp file or staging folder of a writer (Location.temp_name)."""
    return name.startswith(TEMP_PREFIX)


def _boto_errors() -> tuple[type[BaseException], ...]:
    try:
        from botocore.exceptions import BotoCoreError

        return (BotoCoreError,)
    except ImportError:  # botocore comes with s3fs; only absent in stripped installs
        return ()


S3_EXTRA_HINT = "s3:// paths need the s3 extra: pip install 'zeroshard[s3]'"


def _missing_backend(url: str, exc: ImportError) -> str:
    """What to install when fsspec cannot load the filesystem `url` needs."""
    if url.startswith(("s3://", "s3a://")):
        return S3_EXTRA_HINT
    return f"no filesystem for this URL ({describe_error(exc)})"


@contextlib.contextmanager
def storage_errors(where: str) -> Iterator[None]:
    """Turn OSError and S3 client errors raised inside into a StorageError naming `where`."""
    try:
        yield
    except StorageError:
        raise
    except (OSError, *_boto_errors()) as exc:
        raise StorageError(where, describe_error(exc)) from exc


def parse_storage_options(pairs: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """`key=value` strings (from --storage-option) into fsspec options.

    Values are JSON-decoded when they parse (numbers, true/false, objects) so that nested
    options such as client_kwargs={"region_name": "x"} work; otherwise kept as strings.
    """
    import json

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidArgumentError(f"storage option {pair!r} is not key=value")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def local_path(url: str) -> str | None:
    """The absolute path of a plain local `url` (a path, or file://path), as fsspec's local
    filesystem would resolve it; None for anything else (s3://, chained URLs, other protocols),
    which goes through fsspec."""
    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url or "::" in url or url.startswith("file:"):
        return None
    if url.startswith("~"):
        url = os.path.expanduser(url)
    elif not url.startswith("/"):
        url = f"{os.getcwd()}/{'' if url == '.' else url.removeprefix('./')}"
    return url.rstrip("/") or "/"


class Location:
    """A folder that may not exist yet, on any fsspec filesystem.

    A plain local folder is served by os calls and does not import fsspec (about a third of a
    short command's start-up); `fs` is made for it only when something asks for it.
    """

    def __init__(self, url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None):
        url = os.fspath(url)  # pathlib.Path and any os.PathLike, like every path the package takes
        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        self.remote_io, fs_options = split_options(self.storage_options)
        path = None if fs_options else local_path(self.url)
        if path is not None:
            self._fs, self.path, self.local = None, path, True
        else:
            with storage_errors(url):
                try:
                    self._fs, self.path = _filesystem(self.url, fs_options, self.remote_io.retry_s)
                except ImportError as exc:  # s3fs (and other backends) are optional extras
                    raise StorageError(url, _missing_backend(self.url, exc)) from exc
            self.local = "file" in _protocols(self._fs)
        self.read_budget = BlockBudget(self.remote_io.read_ahead)  # read-ahead held, across this folder's readers

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (for a plain local folder, made on first use)."""
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem("file")
        return self._fs

    # ---- naming -------------------------------------------------------------------------
    def url_of(self, name: str = "") -> str:
        """The user-facing URL of `name` inside this folder (for messages)."""
        return f"{self.url}/{name}" if name else self.url

    def full_path(self, name: str) -> str:
        return posixpath.join(self.path, name) if name else self.path

    def temp_name(self, name: str) -> str:
        """A fresh hidden name for staging `name` in this folder."""
        # [Note: temp names]
        # Every temp file and staging folder is named here, nowhere else: TEMP_PREFIX (hidden,
        # and what `clean` and the next writer look for), the writer's owner tag (host and pid:
        # leftovers.py tells a dead writer's leftover from a live one's), a random part, and the
        # final name last (so `clean` can say what it was for).
        return f"{TEMP_PREFIX}{owner_tag()}-{os.urandom(4).hex()}-{name}"

    def child(self, name: str) -> "Location":
        loc = Location.__new__(Location)
        loc.url, loc.storage_options, loc._fs, loc.local = self.url_of(name), self.storage_options, self._fs, self.local
        loc.remote_io, loc.read_budget = self.remote_io, self.read_budget
        loc.path = self.full_path(name)
        return loc

    # ---- queries ------------------------------------------------------------------------
    def exists(self, name: str = "") -> bool:
        with storage_errors(self.url_of(name)):
            if self.local:
                return os.path.lexists(self.full_path(name))
            return bool(self.fs.exists(self.full_path(name)))

    def isdir(self, name: str = "") -> bool:
        with storage_errors(self.url_of(name)):
            if self.local:
                return os.path.isdir(self.full_path(name))
            return bool(self.fs.isdir(self.full_path(name)))

    def size(self, name: str) -> int:
        with storage_errors(self.url_of(name)):
            if self.local:
                return os.stat(self.full_path(name)).st_size
            return int(self.fs.size(self.full_path(name)))

    def list(self) -> list[str]:
        """Names directly inside this folder; empty when it does not exist."""
        with storage_errors(self.url):
            try:
                if self.local:
                    return sorted(os.listdir(self.path))
                entries = self.fs.ls(self.path, detail=False, refresh=True)
            except (FileNotFoundError, NotADirectoryError):
                return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries)

    # ---- reading ------------------------------------------------------------------------
    def is_link(self, name: str = "") -> bool:
        """Whether `name` is a symbolic link (locally; object stores have none)."""
        return self.local and os.path.islink(self.full_path(name))

    def read_bytes(self, name: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes [start, end) of `name` (None: from the beginning / to the end); fewer, as a file
        read gives, where the object ends sooner."""
        with storage_errors(self.url_of(name)):
            if not self.local:
                try:
                    return self.fs.cat_file(self.full_path(name), start=start, end=end)
                except OSError as exc:  # S3 answers a range starting at or past the end (any of an empty
                    # object) "not satisfiable"; a file read there gives no bytes, and so does this
                    if exc.errno != errno.EINVAL or (start or 0) < self.fs.size(self.full_path(name)):
                        raise
                    return b""
            fd, _ = open_regular_file(self.full_path(name), self.url_of(name), follow_links=True)
            with os.fdopen(fd, "rb") as file:
                if start:
                    file.seek(start)
                return file.read() if end is None else file.read(max(0, end - (start or 0)))

    def read_whole_into(self, name: str, into: memoryview) -> bool:
        """Fill `into` with all of local file `name` in one call, if it is a regular file of
        exactly len(into) bytes; False otherwise (remote, a link, a FIFO, another size, any
        OSError). For fast paths that fall back to a checked path which says what is wrong."""
        return self.local and read_regular_file(self.full_path(name), into)

    def open_reader(self, name: str, follow_links: bool = False, size: int | None = None) -> "RangeReader":
        """Ranged reads of `name`. A symbolic link is refused unless follow_links: files of a
        checkpoint are its own, never a link to bytes elsewhere (full models from HF's cache,
        which are links into its blob store, pass follow_links=True). `size`, when known, saves
        remote read-ahead asking for it."""
        return RangeReader(self, name, follow_links, size)

    # ---- writing ------------------------------------------------------------------------
    def makedirs(self) -> None:
        if self.local:
            with storage_errors(self.url):
                os.makedirs(self.path, exist_ok=True)

    def atomic_writer(self, name: str, durable: bool = True, write_behind: bool = False) -> "AtomicWriter":
        return AtomicWriter(self, name, durable, write_behind)

    def fsync(self, names: list[str]) -> None:
        """Make files written with durable=False durable (locally; S3 objects already are).

        Runs the fsyncs concurrently: one process writing many files then syncing them all
        lets the disk flush them together, as `cp` followed by `sync` does.
        """
        if not self.local or not names:
            return
        from concurrent.futures import ThreadPoolExecutor

        def sync_one(name: str) -> None:
            with storage_errors(self.url_of(name)):
                fd = os.open(self.full_path(name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
            list(pool.map(sync_one, names))
        _fsync_dir(self.path)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write a whole small file atomically."""
        with self.atomic_writer(name) as out:
            out.write(data)

    def create_exclusive(self, name: str, data: bytes | memoryview, durable: bool = True) -> bool:
        """Create `name` holding `data` only if it does not exist; False if it does. Atomic: a
        conditional PUT (If-None-Match: *) on S3; locally a durable create writes a temp file and
        hard-links it to `name` (exclusive, like O_EXCL), so a process killed half-way leaves a temp
        file, never an empty or torn `name` that other processes would read as a claim or an owner.
        durable=False (temp files synced later, together: see fsync) creates `name` with O_EXCL and
        writes it in place, without the fsyncs."""
        path = self.full_path(name)
        with storage_errors(self.url_of(name)):
            if not self.local:
                try:
                    self.fs.pipe_file(path, data, mode="create")
                except FileExistsError:
                    return False
                return True
            if durable:
                linked = self._link_exclusive(name, data)
                if linked is not None:
                    return linked
            try:
                fd = self._open_exclusive(path)
            except FileExistsError:
                return False
            try:
                _write_all(fd, data)
                if durable:
                    os.fsync(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)  # never a half-written file under this name
                raise
            os.close(fd)
            if durable:
                _fsync_dir(self.path)
            return True

    def _open_exclusive(self, path: str) -> int:
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:  # no folder yet: made only then (packed.py creates 1,000s)
            self.makedirs()
            return os.open(path, flags, 0o644)

    def _link_exclusive(self, name: str, data: bytes | memoryview) -> bool | None:
        """The durable local create: `data` into a synced temp file, then link(temp, name), which
        fails if `name` exists. None where the filesystem has no hard links (then O_EXCL)."""
        if os.path.lexists(self.full_path(name)):  # the common refusal (an owner file on every
            return False  # memory save) costs no temp file and no fsync; link() still decides races
        temp = self.full_path(self.temp_name(name))
        fd = self._open_exclusive(temp)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(temp, self.full_path(name))
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
                    return None
                raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        _fsync_dir(self.path)
        return True

    def move_into(self, name: str, dest: "Location") -> None:
        """Move file `name` from this folder to the same name in `dest` (same filesystem):
        an atomic rename locally; a server-side copy then delete on S3 (no data through us)."""
        with storage_errors(self.url_of(name)):
            if self.local:
                dest.makedirs()
                os.replace(self.full_path(name), dest.full_path(name))
            else:
                self.fs.copy(self.full_path(name), dest.full_path(name))
                self.fs.rm(self.full_path(name))

    def remove_if_empty(self, name: str = "") -> None:
        """Remove the local folder `name` if nothing is in it (else, or if gone, leave it); object
        stores have no folders. Never removes anything another process may have put there."""
        if self.local:
            with contextlib.suppress(OSError):
                os.rmdir(self.full_path(name))

    def remove(self, name: str, recursive: bool = False) -> None:
        """Remove file `name` (gone already: nothing to do); `recursive`: a folder and all in it.
        Locally a link is removed itself, never what it points at, and fsspec is not imported."""
        with storage_errors(self.url_of(name)):
            path = self.full_path(name)
            if self.local:
                with contextlib.suppress(FileNotFoundError):
                    if recursive and os.path.isdir(path) and not os.path.islink(path):
                        import shutil  # here: it imports bz2, lzma and zlib, a cost to every command's start-up

                        shutil.rmtree(path)  # never follows links inside the tree
                    else:
                        os.unlink(path)
            elif self.fs.exists(path):
                self.fs.rm(path, recursive=recursive)


def _filesystem(url: str, options: dict[str, Any], retry_s: float) -> tuple[Any, str]:
    """(fsspec filesystem, path) for `url`. Plain s3:// URLs get s3fs with its retries bounded
    in time by `zeroshard_retry_s` (s3_retry.py); anything else is fsspec's as it comes."""
    if url.startswith(("s3://", "s3a://")) and "::" not in url:
        from zeroshard.storage.s3_retry import BoundedS3FileSystem

        kwargs = {**BoundedS3FileSystem._get_kwargs_from_urls(url), **options}
        return BoundedS3FileSystem(retry_s=retry_s, **kwargs), BoundedS3FileSystem._strip_protocol(url)
    import fsspec

    return fsspec.core.url_to_fs(url, **options)


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


class RangeReader:
    """Ranged reads of one file: os.pread locally (no buffering), GET ranges on S3.

    Remotely, reads go through a BlockReader (read_ahead.py): large reads become concurrent
    block GETs, and reads in order fetch the next blocks ahead, at most `zeroshard_read_ahead`
    GETs in flight. close() cancels what is still in flight.

    Locally, `view()` also lends read-only zero-copy views of the file (a memory map of the page
    cache): a copy loop that writes those views straight out does one copy instead of two, as
    `cp` does. `release()` drops a lent range from this process's mapping when it is done with,
    so resident memory stays at the few chunks in use, whatever the file size.
    """

    def __init__(self, location: Location, name: str, follow_links: bool = False, size: int | None = None):
        self.where = location.url_of(name)
        self._location, self._name = location, name
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._size = 0
        self._remote: BlockReader | None = None
        if location.local:
            if not follow_links and os.path.islink(location.full_path(name)):
                raise StorageError(self.where, "is a symbolic link; zeroshard reads a checkpoint's own files only, "
                                               "never a link to bytes elsewhere")
            self._fd, self._size = open_regular_file(location.full_path(name), self.where, follow_links)
        else:
            from zeroshard.storage.read_ahead import BlockReader

            self._remote = BlockReader(location, name, location.remote_io, location.read_budget, size)

    def view(self, offset: int, length: int) -> memoryview | None:
        """Bytes [offset, offset + length) without copying, or None where that is not possible
        (remote files). The view stays valid until close(); short files are errors."""
        if self._fd is None:
            return None
        if offset + length > self._size:
            raise StorageError(self.where, f"file is truncated: wanted bytes [{offset}, {offset + length}), "
                                           f"file has {self._size}")
        if self._map is None:
            if self._size == 0:
                return memoryview(b"")
            with storage_errors(self.where):
                # no MADV_SEQUENTIAL: it lets the kernel evict pages behind us, and the next
                # reader of this checkpoint would pay for the disk again
                self._map = mmap.mmap(self._fd, self._size, access=mmap.ACCESS_READ)
        return memoryview(self._map)[offset:offset + length]

    def release(self, offset: int, length: int) -> None:
        """Unmap the whole pages inside [offset, offset + length) from this process (the page
        cache keeps them; a later view() maps them again)."""
        if self._map is None:
            return
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + length) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the bytes at [offset, offset + len(buffer)); short reads are errors."""
        want = len(buffer)
        if self._fd is not None:
            got = 0
            with storage_errors(self.where):
                while got < want:
                    n = os.preadv(self._fd, [buffer[got:]], offset + got)
                    if n == 0:
                        break
                    got += n
        else:
            got = self._remote.read_into(offset, buffer)
        if got != want:
            raise StorageError(self.where, f"file is truncated: wanted bytes [{offset}, {offset + want}), got {got}")

    def read(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(offset, memoryview(buffer))
        return bytes(buffer)

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: the GC closes it
                self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AtomicWriter:
    """A file that appears under its name only if the `with` block finishes without error.

    durable=False skips the local fsync before the rename: for files that are synced later,
    together, before anything vouches for them (see Location.fsync).

    write_behind=True hands each write to a background thread, so the caller reads (and hashes)
    the next chunk while this one is written: a copy loop then costs about max(read, write)
    rather than their sum. At most one write is in flight: the caller must leave the data of a
    write() unchanged until its next write() returns (two alternating buffers suffice; through a
    SafetensorsStreamWriter, see [Note: write-behind buffers] in stream_writer.py).

    On S3 the bytes go up as a multipart upload whose parts upload concurrently (multipart.py,
    `zeroshard_part_size` x `zeroshard_uploads_in_flight`); a write returns once its bytes are
    copied into the part being filled, and waits only while that many parts are uploading.
    """

    def __init__(self, location: Location, name: str, durable: bool = True, write_behind: bool = False):
        self.where = location.url_of(name)
        self._location, self._name, self._durable = location, name, durable
        self._file: Any = None
        self._temp: str | None = None
        self._executor: ThreadPoolExecutor | None = None
        if write_behind:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, "zeroshard-write")
        self._pending: Future | None = None
        self._writeback: WritebackPacer | None = None  # local files
        self.bytes_written = 0

    def __enter__(self) -> "AtomicWriter":
        loc = self._location
        with storage_errors(self.where):
            if loc.local:
                loc.makedirs()
                self._temp = loc.full_path(loc.temp_name(self._name))
                self._file = open(self._temp, "wb", buffering=0)
                self._writeback = WritebackPacer()
                return self
            from zeroshard.storage.multipart import ConcurrentMultipartUpload, is_s3

            if is_s3(loc.fs):  # parts upload concurrently; completed at commit, aborted on failure
                self._file = ConcurrentMultipartUpload(loc.fs, loc.full_path(self._name), loc.remote_io)
            else:
                self._file = loc.fs.open(loc.full_path(self._name), "wb", autocommit=False)
        return self

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._executor is None:
            self._write_now(view)
            return
        self._wait_pending()
        self._pending = self._executor.submit(self._write_now, view)

    def _write_now(self, view: memoryview) -> None:
        with storage_errors(self.where):
            due = self._writeback is not None and self._writeback.due(len(view))
            while view:  # raw local files may write partially
                n = self._file.write(view)
                n = len(view) if n is None else n
                self.bytes_written += n
                view = view[n:]
            if due:
                start_writeback(self._file.fileno())  # [Note: early writeback] in writeback.py

    def _wait_pending(self) -> None:
        """Let the write in flight finish; its error, if any, is raised here."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            if exc_type is None:
                self._wait_pending()
                self._commit()
            else:
                with contextlib.suppress(Exception):
                    self._wait_pending()
                self._discard()
        except BaseException as error:
            self._discard()
            if isinstance(error, StorageError) and self._pending_note():
                raise StorageError(error.where, error.problem + self._pending_note()) from error
            raise
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
        if isinstance(exc, StorageError) and self._pending_note():  # the error that ended the `with` block
            raise StorageError(exc.where, exc.problem + self._pending_note()) from exc

    def _pending_note(self) -> str:
        """What to add to the error when the S3 upload's abort did not get through."""
        if not getattr(self._file, "maybe_pending", False):
            return ""
        folder = self._location.url
        if folder.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):  # a staging folder: name its output
            folder = folder.rsplit("/", 1)[0]
        return (f"; its multipart upload could not be aborted and may be left pending (S3 bills for it): "
                f"the next run into this output aborts it, or `zeroshard clean {folder} --older-than 0s --yes`")

    def _commit(self) -> None:
        loc = self._location
        try:
            with storage_errors(self.where):
                if loc.local:
                    if self._durable:
                        os.fsync(self._file.fileno())
                    self._file.close()
                    os.replace(self._temp, loc.full_path(self._name))
                    self._temp = None
                    if self._durable:
                        _fsync_dir(loc.path)
                else:
                    self._file.close()
                    self._file.commit()
        except BaseException:
            self._discard()
            raise

    def _discard(self) -> None:
        loc = self._location
        with contextlib.suppress(Exception):
            if loc.local:
                if self._file is not None and not self._file.closed:
                    self._file.close()
                if self._temp is not None and os.path.exists(self._temp):
                    os.unlink(self._temp)
            elif self._file is not None:
                self._file.discard()
                self._file.closed = True  # nothing left to flush; stops __del__ from uploading


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:  # a write may be partial
        view = view[os.write(fd, view):]


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def open_regular_file(path: str, where: str, follow_links: bool) -> tuple[int, int]:
    """(a read-only descriptor, the size) of the regular file at `path`. Opened non-blocking, so
    that a FIFO (which would block until a writer comes) or a device is refused instead of
    hanging the command; O_NOFOLLOW unless `follow_links`, so a link cannot be swapped in after a
    check."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    with storage_errors(where):
        fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        mode = info.st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
            raise StorageError(where, f"is not a regular file ({kind})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_regular_file(path: str, into: memoryview) -> bool:
    """Fill `into` with the whole local file at `path` if it is a regular file of exactly
    len(into) bytes; False otherwise (a link, which is refused as RangeReader does; a FIFO or
    device, opened non-blocking so it cannot hang the caller; another size; any OSError). For
    fast paths that fall back to a checked, slower path which says what is wrong."""
    try:
        fd, size = open_regular_file(path, path, follow_links=False)
    except StorageError:
        return False
    try:
        if size != len(into):
            return False
        got = 0
        while got < len(into):
            n = os.readv(fd, [into[got:]])
            if not n:
                return False
            got += n
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
