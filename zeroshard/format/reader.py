"""Reading element ranges of global tensors out of a checkpoint's rank files.

Only the bytes asked for are read (os.pread locally, HTTP range requests on S3). Each rank
file's header is read once and checked against the manifest before any data is trusted.
Fragment hashes are checked whenever a fragment is read front to back, across as many calls
as it takes, which is how consolidate and reshard read; a mismatch is an error naming the file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from zeroshard.errors import CheckpointError
from zeroshard.format.manifest import FileEntry, Fragment, Manifest, TensorEntry
from zeroshard.partition import Piece, pieces
from zeroshard.storage.hashing import new_hasher
from zeroshard.storage.location import Location, RangeReader
from zeroshard.storage.safetensors_header import Header, read_header

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # small enough to stay in cache between the read, the hash and the write
REMOTE_CHUNK_BYTES = 32 * 1024 * 1024  # fewer, larger range requests where each costs a round trip


def chunk_bytes_for(location: Location) -> int:
    """The copy-buffer size for streaming from `location`."""
    return DEFAULT_CHUNK_BYTES if location.local else REMOTE_CHUNK_BYTES


def check_header(header: Header, file: FileEntry, manifest: Manifest) -> list[str]:
    """Disagreements between a rank file's header and the manifest, as messages."""
    problems = []
    meta = header.metadata
    expected = {"format_version": manifest.version, "checkpoint_id": manifest.id,
                "rank": str(file.rank), "world_size": str(manifest.world_size)}
    for key, value in expected.items():
        if key == "format_version":
            if meta.get(key, "").split(".")[0] != value.split(".")[0]:
                problems.append(f"header says format version {meta.get(key)!r}, manifest {value!r}")
        elif meta.get(key) != value:
            problems.append(f"header {key} is {meta.get(key)!r}, manifest expects {value!r}"
                            + (" (a file from another save?)" if key == "checkpoint_id" else ""))
    if header.file_size != file.size:
        problems.append(f"header implies {header.file_size} bytes, manifest records {file.size}")
    wanted = {}
    for t in manifest.tensors.values():
        for f in t.fragments:
            if f.rank == file.rank:
                wanted[t.name] = (t, f)
    for name, (t, f) in wanted.items():
        entry = header.entries.get(name)
        if entry is None:
            problems.append(f"tensor {name!r} is missing from the file")
        elif entry.dtype != t.dtype:
            problems.append(f"tensor {name!r} is {entry.dtype} in the file, {t.dtype} in the manifest")
        elif entry.shape != (f.numel,):
            problems.append(f"tensor {name!r} has shape {list(entry.shape)} in the file, manifest fragment has {f.numel} elements")
    for name in header.entries:
        if name not in wanted:
            problems.append(f"tensor {name!r} is in the file but not in the manifest")
    return problems


class CheckpointReader:
    """Ranged, verified reads from one checkpoint. Use as a context manager."""

    def __init__(self, location: Location, manifest: Manifest, verify_hashes: bool = True):
        self.location = location
        self.manifest = manifest
        self.verify_hashes = verify_hashes
        self._files = {f.rank: f for f in manifest.files}
        self._open: dict[int, tuple[RangeReader, Header]] = {}
        # (tensor, rank) -> (hasher, next byte offset inside the fragment); absent when a read skipped bytes
        self._hashing: dict[tuple[str, int], tuple[object, int]] = {}
        self._unverified: set[tuple[str, int]] = set()
        self._buffers = [bytearray(), bytearray()]  # reused by iter_range: allocating per tensor costs more than the copy
        self._turn = 0
        self._lent: list[tuple[RangeReader, int, int]] = []  # zero-copy views handed out, oldest first
        self.bytes_read = 0

    def _file(self, rank: int) -> tuple[RangeReader, Header]:
        if rank not in self._open:
            file = self._files[rank]
            reader = self.location.open_reader(file.name)
            try:
                size = self.location.size(file.name)
                if size != file.size:
                    problem = "truncated" if size < file.size else "longer than recorded"
                    raise CheckpointError(reader.where, f"file is {problem}: {size} bytes, manifest records {file.size}")
                header = read_header(reader, size)
                problems = check_header(header, file, self.manifest)
                if problems:
                    raise CheckpointError(reader.where, problems[0])
            except BaseException:
                reader.close()
                raise
            self._open[rank] = (reader, header)
        return self._open[rank]

    def where(self, rank: int) -> str:
        return self.location.url_of(self._files[rank].name)

    def read_into(self, tensor: TensorEntry, start: int, buffer: memoryview) -> None:
        """Fill `buffer` with tensor elements starting at flat index `start` (len must be a
        multiple of the item size)."""
        size = tensor.itemsize
        for piece in self._plan(tensor, start, start + len(buffer) // size):
            fragment = tensor.fragments[piece.source]
            reader, header = self._file(fragment.rank)
            entry = header.entries[tensor.name]
            out = buffer[piece.target_offset * size:(piece.target_offset + piece.length) * size]
            offset = piece.source_offset * size
            reader.read_into(entry.begin + offset, out)
            self.bytes_read += len(out)
            if self.verify_hashes:
                self._hash(tensor.name, fragment, offset, out)

    def read_flat(self, tensor: TensorEntry, start: int = 0, end: int | None = None) -> "torch.Tensor":
        """Elements [start, end) of a global tensor as a new 1-D torch tensor."""
        import torch

        from zeroshard.storage.safetensors_header import torch_dtype

        end = tensor.numel if end is None else end
        out = torch.empty(end - start, dtype=torch_dtype(tensor.dtype))
        if end > start:
            self.read_into(tensor, start, memoryview(out.view(torch.uint8).numpy()))
        return out

    def iter_range(self, tensor: TensorEntry, start: int, end: int,
                   chunk_bytes: int | None = None) -> Iterator[memoryview]:
        """Yield the bytes of elements [start, end) in order, in chunks of at most `chunk_bytes`
        (default: by location, see chunk_bytes_for).

        A yielded view stays valid while the next one is produced (what a write-behind writer
        needs) and may be reused after that. Local files lend zero-copy views of the page cache;
        remote ones are read into two alternating buffers.
        """
        chunk_bytes = chunk_bytes or chunk_bytes_for(self.location)
        size = tensor.itemsize
        if self.location.local:
            yield from self._iter_views(tensor, start, end, max(size, chunk_bytes // size * size))
            return
        step = max(1, chunk_bytes // size)
        need = min(step, max(end - start, 0)) * size
        for i, buffer in enumerate(self._buffers):
            if len(buffer) < need:
                self._buffers[i] = bytearray(need)
        for chunk_start in range(start, end, step):
            n = min(step, end - chunk_start)
            self._turn ^= 1  # alternate across calls too: the last chunk of the previous tensor may be in flight
            view = memoryview(self._buffers[self._turn])[:n * size]
            self.read_into(tensor, chunk_start, view)
            yield view

    def _plan(self, tensor: TensorEntry, start: int, end: int) -> list[Piece]:
        """Which fragments hold elements [start, end), in order (zeroshard.partition.pieces)."""
        try:
            return pieces((start, end), [(f.start, f.end) for f in tensor.fragments])
        except ValueError as exc:
            raise CheckpointError(self.location.url, f"tensor {tensor.name!r}: {exc}") from None

    def _iter_views(self, tensor: TensorEntry, start: int, end: int, chunk: int) -> Iterator[memoryview]:
        size = tensor.itemsize
        for piece in self._plan(tensor, start, end):
            fragment = tensor.fragments[piece.source]
            reader, header = self._file(fragment.rank)
            first = piece.source_offset * size
            for offset in range(first, first + piece.length * size, chunk):
                length = min(chunk, first + piece.length * size - offset)
                view = reader.view(header.entries[tensor.name].begin + offset, length)
                self.bytes_read += length
                if self.verify_hashes:
                    self._hash(tensor.name, fragment, offset, view)
                self._lent.append((reader, header.entries[tensor.name].begin + offset, length))
                if len(self._lent) > 2:  # two behind: the previous view may still be being written
                    lender, lent_at, lent_length = self._lent.pop(0)
                    lender.release(lent_at, lent_length)
                yield view

    def _hash(self, name: str, fragment: Fragment, offset: int, data: memoryview) -> None:
        key = (name, fragment.rank)
        if key in self._unverified:
            return
        hasher, expected = self._hashing.get(key, (None, 0))
        if offset != expected:  # not read front to back: this fragment cannot be checked here
            self._hashing.pop(key, None)
            self._unverified.add(key)
            return
        if hasher is None:
            hasher = new_hasher()
        hasher.update(data)
        position = offset + len(data)
        if position == fragment.numel * self.manifest.tensors[name].itemsize:
            self._hashing.pop(key, None)
            if hasher.hexdigest() != fragment.hash:
                raise CheckpointError(self.where(fragment.rank),
                                      f"tensor {name!r}: content hash mismatch (file corrupt or modified)")
        else:
            self._hashing[key] = (hasher, position)

    def close(self) -> None:
        for reader, _ in self._open.values():
            reader.close()
        self._open.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
