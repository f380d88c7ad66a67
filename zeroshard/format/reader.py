"""Reading element ranges of global tensors out of a checkpoint's rank files.

Only the bytes asked for are read (os.pread locally, HTTP range requests on S3), and only from
the files that hold them: which ranks hold a range follows from the tensor's layout
(zeroshard.partition.holders), so planning one rank's share costs O(ranks touched), whatever
the world size. Each rank file's header is read once and checked against the manifest before
any data is trusted. Fragment hashes (the file's own table in 1.1, the manifest's list in 1.0)
are checked whenever a fragment is read front to back, across as many calls as it takes, which
is how consolidate and reshard read; a mismatch is an error naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator

from zeroshard.errors import CheckpointError
from zeroshard.format.layouts import RankLayouts, layouts_of
from zeroshard.format.manifest import FORMAT_NAME, HASH_TABLE_NAME, FileEntry, Manifest, TensorEntry, rank_contents
from zeroshard.format.writer import parse_hash_table
from zeroshard.partition import holders
from zeroshard.storage.hashing import HashingThread, new_hasher
from zeroshard.storage.location import Location, RangeReader
from zeroshard.storage.safetensors_header import Header, HeaderEntry, build_header_bytes, read_header

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # small enough to stay in cache between the read, the hash and the write
REMOTE_CHUNK_BYTES = 32 * 1024 * 1024  # fewer, larger range requests where each costs a round trip


def chunk_bytes_for(location: Location) -> int:
    """The copy-buffer size for streaming from `location`."""
    return DEFAULT_CHUNK_BYTES if location.local else REMOTE_CHUNK_BYTES


def fragments_of(tensor: TensorEntry, world_size: int, start: int = 0,
                 end: int | None = None) -> list[tuple[int, int, int]]:
    """(rank, fragment start, fragment end) of every fragment holding elements of [start, end), in order."""
    end = tensor.numel if end is None else end
    if tensor.layout == "flat":
        return [(rank, s, e) for rank, (s, e) in holders(tensor.numel, world_size, start, end)]
    holder = tensor.owner if tensor.layout == "local" else 0
    return [(holder, 0, tensor.numel)] if tensor.numel and start < end else []


def check_header(header: Header, file: FileEntry, manifest: Manifest) -> list[str]:
    """Disagreements between a rank file's header and the manifest, as messages (the most
    telling first: CheckpointReader reports only that one)."""
    problems = []
    meta = header.metadata
    table = header.entries.get(HASH_TABLE_NAME)
    # A file of the other format version explains every other difference: say that, once.
    version_problem = _version_mismatch(meta.get("format_version"), table is not None, manifest.version)
    if version_problem:
        problems.append(version_problem)
    expected = {"format_version": manifest.version, "checkpoint_id": manifest.id,
                "rank": str(file.rank), "world_size": str(manifest.world_size)}
    for key, value in expected.items():
        if meta.get(key) != value and not (key == "format_version" and version_problem):
            problems.append(f"header {key} is {str(meta.get(key))[:40]!r}, manifest expects {value!r}"
                            + (" (a file from another save?)" if key == "checkpoint_id" else ""))
    if header.file_size != file.size:
        problems.append(f"header implies {header.file_size} bytes, manifest records {file.size}")
    contents = rank_contents(manifest.tensors.values(), manifest.world_size, file.rank)
    for t, start, end in contents:
        entry = header.entries.get(t.name)
        if entry is None:
            problems.append(f"tensor {t.name!r} is missing from the file")
        elif entry.dtype != t.dtype:
            problems.append(f"tensor {t.name!r} is {entry.dtype} in the file, {t.dtype} in the manifest")
        elif entry.shape != (end - start,):
            problems.append(f"tensor {t.name!r} has shape {list(entry.shape)} in the file, manifest fragment has "
                            f"{end - start} elements")
    known = {t.name for t, _, _ in contents}
    if manifest.legacy_hashes is None:
        known.add(HASH_TABLE_NAME)
        if table is not None and (table.dtype != "U64" or table.shape != (len(contents),)):
            problems.append(f"fragment hash table {HASH_TABLE_NAME!r} is {table.dtype}{list(table.shape)}, "
                            f"expected U64[{len(contents)}] (one hash per tensor in the file)")
        elif table is not None and table.end != header.file_size:
            problems.append(f"fragment hash table {HASH_TABLE_NAME!r} is not the file's last tensor")
    stray = [n for n in header.entries if n not in known and not (n == HASH_TABLE_NAME and version_problem)]
    if stray:
        more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
        problems.append(f"tensor {stray[0][:80]!r} is in the file but not in the manifest{more}")
    return problems


def _version_mismatch(file_version: object, has_table: bool, manifest_version: str) -> str | None:
    """The message for a rank file whose hash table says it is of another format version than
    the manifest's (1.1 files carry a fragment hash table, 1.0 files do not), else None."""
    said = "" if file_version == manifest_version else f"; its header says format {str(file_version)[:40]!r}"
    if manifest_version != "1.0" and not has_table:
        why = "written by format 1.0" if file_version == "1.0" else "written by format 1.0, or removed?"
        return (f"no fragment hash table {HASH_TABLE_NAME!r} in its header ({why}{said}) but the manifest says "
                f"format {manifest_version}")
    if manifest_version == "1.0" and has_table:
        return (f"has a fragment hash table {HASH_TABLE_NAME!r} (written by format 1.1 or later{said}) but the "
                "manifest says format 1.0")
    return None


def expected_header(file: FileEntry, manifest: Manifest) -> tuple[bytes, Header]:
    """The exact header bytes a zeroshard writer puts in this rank file, and what they say."""
    contents = rank_contents(manifest.tensors.values(), manifest.world_size, file.rank)
    metadata = {"format": FORMAT_NAME, "format_version": manifest.version, "checkpoint_id": manifest.id,
                "rank": str(file.rank), "world_size": str(manifest.world_size)}
    layout = [(t.name, t.dtype, (end - start,)) for t, start, end in contents]
    if manifest.legacy_hashes is None:
        layout.append((HASH_TABLE_NAME, "U64", (len(contents),)))
    raw, relative = build_header_bytes(layout, metadata)
    start = len(raw)
    entries = {n: HeaderEntry(d, s, start + b, start + e) for n, (d, s, b, e) in relative.items()}
    return raw, Header(entries, metadata, start, start + max((e for *_, e in relative.values()), default=0))


def read_rank_header(reader: RangeReader, file: FileEntry, manifest: Manifest, size: int,
                     layouts: RankLayouts | None = None) -> tuple[Header, list[str]]:
    """A rank file's header and its disagreements with the manifest.

    Fast path: a header byte-identical to the one the manifest implies is right by construction
    (one comparison instead of parsing thousands of entries: a 1,000-rank reshard reads 300,000).
    With `layouts` (made once per checkpoint), that header is composed without a loop over the
    file's tensors. Anything else is parsed and checked field by field, for a precise message.
    """
    raw, header = layouts.expected(file.rank) if layouts is not None else expected_header(file, manifest)
    if size == header.file_size == file.size and reader.read(0, len(raw)) == raw:
        return header, []
    header = read_header(reader, size)
    return header, check_header(header, file, manifest)


HASHED_READ_BYTES = 1 << 20
HASHED_BEHIND_BYTES = 4 << 20  # hashed on another core: fewer, larger jobs (no cache to stay in)


@dataclass
class OpenFile:
    reader: RangeReader
    header: Header
    hashes: dict[str, str] | None = None  # fragment hashes from the file's table, read on first use


class CheckpointReader:
    """Ranged, verified reads from one checkpoint. Use as a context manager."""

    def __init__(self, location: Location, manifest: Manifest, verify_hashes: bool = True,
                 complete_fragments: bool = False, hash_behind: bool = False):
        """complete_fragments: a read_into that covers only part of a saved fragment also reads
        (into scratch) and hashes the rest of it, so every byte it returns is verified. For
        callers that read each (tensor, rank) range once, such as a load at another world size;
        readers that read whole fragments (the toolkit) never need it.
        hash_behind (local files): read_into hands its hashing to a background thread, and the
        next read overlaps it. Its buffers must then stay unchanged, and unused, until `settle()`
        returns; leaving the `with` block settles too. For a caller with a core to spare, such
        as an engine load with fewer ranks than cores on the node: with one rank per core, the
        thread would only take turns with the reads."""
        self.location = location
        self.manifest = manifest
        self.verify_hashes = verify_hashes
        self.complete_fragments = complete_fragments and verify_hashes
        self._open: dict[int, OpenFile] = {}
        self._layouts: RankLayouts | None = None  # every rank file's expected header, made on first open
        # (tensor, rank) -> (hasher, next byte offset inside the fragment); absent when a read skipped bytes
        self._hashing: dict[tuple[str, int], tuple[object, int]] = {}
        self._unverified: set[tuple[str, int]] = set()
        # reused by iter_range: allocating per tensor costs more than the copy
        self._buffers = [bytearray(), bytearray()]
        self._turn = 0
        self._lent: list[tuple[RangeReader, int, int]] = []  # zero-copy views handed out, oldest first
        self._behind = HashingThread() if hash_behind and self.verify_hashes and location.local else None
        self.bytes_read = 0

    def open_file(self, rank: int) -> OpenFile:
        """Rank `rank`'s file, opened and its header checked against the manifest (once)."""
        if rank not in self._open:
            file = self.manifest.file_for_rank(rank)
            size = self.location.size(file.name)
            reader = self.location.open_reader(file.name, size=size)
            try:
                if size != file.size:
                    problem = "truncated" if size < file.size else "longer than recorded"
                    raise CheckpointError(reader.where,
                                          f"file is {problem}: {size} bytes, manifest records {file.size}")
                if self._layouts is None:
                    self._layouts = layouts_of(self.manifest)
                header, problems = read_rank_header(reader, file, self.manifest, size, self._layouts)
                if problems:
                    raise CheckpointError(reader.where, problems[0])
            except BaseException:
                reader.close()
                raise
            self._open[rank] = OpenFile(reader, header)
        return self._open[rank]

    def fragment_hash(self, name: str, rank: int) -> str:
        """The recorded hash of `name`'s fragment in `rank`'s file."""
        return self.fragment_hashes(rank)[name]

    def fragment_hashes(self, rank: int) -> dict[str, str]:
        """Every recorded fragment hash of `rank`'s file, by tensor name."""
        opened = self.open_file(rank)
        if opened.hashes is None:
            if self.manifest.legacy_hashes is not None:
                opened.hashes = {name: self.manifest.legacy_hashes[(name, rank)] for name in opened.header.entries}
            else:
                opened.hashes = read_hash_table(opened.reader, opened.header)
        return opened.hashes

    def where(self, rank: int) -> str:
        return self.location.url_of(self.manifest.file_for_rank(rank).name)

    def read_into(self, tensor: TensorEntry, start: int, buffer: memoryview, until: int | None = None) -> None:
        """Fill `buffer` with tensor elements starting at flat index `start` (len must be a
        multiple of the item size). `until`: where the caller's whole read ends, when it reads
        [start, until) in several calls, front to back (complete_fragments then hashes a
        fragment's unread rest once, at the call that ends the read, not at every call)."""
        size = tensor.itemsize
        end = start + len(buffer) // size
        last = until is None or end >= until
        for rank, source_offset, target_offset, length in self._plan(tensor, start, end):
            opened = self.open_file(rank)
            entry = opened.header.entries[tensor.name]
            out = buffer[target_offset * size:(target_offset + length) * size]
            offset = source_offset * size
            # Locally, read and hash in pieces that are still in the CPU cache when hashed: a
            # verified read then costs ~1.2x an unverified one instead of ~1.5x (docs/BENCHMARKS.md).
            step = HASHED_READ_BYTES if self.verify_hashes and self.location.local else max(1, len(out))
            step = HASHED_BEHIND_BYTES if self._behind is not None else step
            complete = self.complete_fragments and (tensor.name, rank) not in self._hashing
            if complete and offset > 0:
                self._hash_unused(tensor, rank, opened, entry, 0, offset)
            for at in range(0, len(out), step):
                piece = out[at: at + step]
                opened.reader.read_into(entry.begin + offset + at, piece)
                if self.verify_hashes:
                    self._hash(tensor, rank, offset + at, piece, behind=True)
            if self.complete_fragments and last and offset + len(out) < entry.end - entry.begin:
                self._hash_unused(tensor, rank, opened, entry, offset + len(out), entry.end - entry.begin)
            self.bytes_read += len(out)

    def _hash_unused(self, tensor: TensorEntry, rank: int, opened: OpenFile, entry: HeaderEntry, begin: int,
                     end: int) -> None:
        """Read bytes [begin, end) of a fragment that the caller does not want, only to hash them
        (here, in order after the fragment's hashing behind: the scratch buffer is reused)."""
        self.settle()
        scratch = memoryview(bytearray(min(HASHED_READ_BYTES, end - begin)))
        for at in range(begin, end, len(scratch)):
            piece = scratch[: min(len(scratch), end - at)]
            opened.reader.read_into(entry.begin + at, piece)
            self._hash(tensor, rank, at, piece)
        self.bytes_read += end - begin

    def read_flat(self, tensor: TensorEntry, start: int = 0, end: int | None = None) -> "torch.Tensor":
        """Elements [start, end) of a global tensor as a new 1-D torch tensor."""
        import torch

        from zeroshard.storage.safetensors_header import torch_dtype

        end = tensor.numel if end is None else end
        out = torch.empty(end - start, dtype=torch_dtype(tensor.dtype))
        if end > start:
            self.read_into(tensor, start, memoryview(out.view(torch.uint8).numpy()))
            self.settle()  # the caller uses it at once
        return out

    def hash_mark(self) -> int:
        """A mark for settle(upto=): what read_into has handed to the hashing thread so far."""
        return 0 if self._behind is None else self._behind.submitted

    def settle(self, upto: int | None = None) -> None:
        """With hash_behind: wait until the bytes read before mark `upto` (default: everything
        read) are hashed, and raise the first mismatch found. Without it, returns at once."""
        if self._behind is not None:
            self._behind.settle(upto)

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

    def iter_planned(self, requests: Iterable[tuple[TensorEntry, int, int]]) -> Iterator[memoryview]:
        """The bytes of every (tensor, start, end) request, in order, as chunks of whole elements.

        Remote checkpoints: the whole read list is known up front, so it goes to read_ranges,
        which keeps several GETs in flight across pieces and files (a consolidation hopping
        between weights and optimizer state no longer waits on one GET at a time). Fragments
        read front to back are hash-checked as usual. Locally: iter_range, request by request.
        """
        requests = list(requests)
        if self.location.local:
            for tensor, start, end in requests:
                yield from self.iter_range(tensor, start, end)
            return
        from zeroshard.storage.read_ahead import read_ranges

        block = self.location.remote_io.block_bytes
        ranges, owners = [], []
        for tensor, start, end in requests:
            size = tensor.itemsize
            step = max(1, block // size) * size
            for rank, source_offset, _, length in self._plan(tensor, start, end):
                opened = self.open_file(rank)
                first = opened.header.entries[tensor.name].begin + source_offset * size
                for offset in range(first, first + length * size, step):
                    n = min(step, first + length * size - offset)
                    ranges.append((self.manifest.file_for_rank(rank).name, offset, n))
                    owners.append((tensor, rank, offset - opened.header.entries[tensor.name].begin))
        for (tensor, rank, offset), data in zip(owners, read_ranges(self.location, ranges)):
            view = memoryview(data)
            self.bytes_read += len(view)
            if self.verify_hashes:
                self._hash(tensor, rank, offset, view)
            yield view

    def _plan(self, tensor: TensorEntry, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """(rank, offset in its fragment, offset in the target, length) in elements, covering
        [start, end) in order."""
        if not 0 <= start <= end <= tensor.numel:
            raise CheckpointError(self.location.url, f"tensor {tensor.name!r}: elements [{start}, {end}) are "
                                                     f"outside its {tensor.numel}")
        plan = []
        for rank, frag_start, frag_end in fragments_of(tensor, self.manifest.world_size, start, end):
            lo, hi = max(start, frag_start), min(end, frag_end)
            plan.append((rank, lo - frag_start, lo - start, hi - lo))
        return plan

    def _iter_views(self, tensor: TensorEntry, start: int, end: int, chunk: int) -> Iterator[memoryview]:
        size = tensor.itemsize
        for rank, source_offset, _, length in self._plan(tensor, start, end):
            opened = self.open_file(rank)
            begin = opened.header.entries[tensor.name].begin
            first = source_offset * size
            for offset in range(first, first + length * size, chunk):
                n = min(chunk, first + length * size - offset)
                view = opened.reader.view(begin + offset, n)
                self.bytes_read += n
                if self.verify_hashes:
                    self._hash(tensor, rank, offset, view)
                self._lent.append((opened.reader, begin + offset, n))
                if len(self._lent) > 2:  # two behind: the previous view may still be being written
                    lender, lent_at, lent_length = self._lent.pop(0)
                    lender.release(lent_at, lent_length)
                yield view

    def _hash(self, tensor: TensorEntry, rank: int, offset: int, data: memoryview, behind: bool = False) -> None:
        """Hash `data` (bytes [offset, ...) of the fragment) into its fragment's running hash and,
        at the fragment's end, check it; `behind`: on the hashing thread, when there is one."""
        key = (tensor.name, rank)
        if key in self._unverified:
            return
        hasher, expected = self._hashing.get(key, (None, 0))
        if offset != expected:  # not read front to back: this fragment cannot be checked here
            self._hashing.pop(key, None)
            self._unverified.add(key)
            return
        if hasher is None:
            hasher = new_hasher()
        position = offset + len(data)
        entry = self.open_file(rank).header.entries[tensor.name]
        recorded = None
        if position == entry.end - entry.begin:
            self._hashing.pop(key, None)
            recorded = self.fragment_hash(tensor.name, rank)
        else:
            self._hashing[key] = (hasher, position)
        job = (hasher, data, recorded, self, rank, tensor.name)
        if self._behind is None:  # the toolkit's readers: no thread, nothing to wait for
            _update_and_check(*job)
        elif behind:
            self._behind.submit(_update_and_check, *job)
        else:
            self._behind.settle()  # the fragment's earlier pieces may still be on the hashing thread
            _update_and_check(*job)

    def close(self) -> None:
        if self._behind is not None:
            self._behind.close()  # no job may outlive the buffers it reads
        for opened in self._open.values():
            opened.reader.close()
        self._open.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                self.settle()  # a mismatch found behind is never dropped
        finally:
            self.close()


def _update_and_check(hasher: object, data: memoryview, recorded: str | None, reader: CheckpointReader, rank: int,
                      name: str) -> None:
    """Add `data` to a fragment's running hash; with `recorded` (the fragment's end), check it."""
    hasher.update(data)
    if recorded is not None and hasher.hexdigest() != recorded:
        raise CheckpointError(reader.where(rank), f"tensor {name!r}: content hash mismatch (file corrupt or modified)")


def read_hash_table(reader: RangeReader, header: Header) -> dict[str, str]:
    """A 1.1 rank file's fragment hashes by tensor name (its table lists them in data-offset order)."""
    table = header.entries[HASH_TABLE_NAME]
    hashes = parse_hash_table(reader.read(table.begin, table.end - table.begin))
    names = [n for n, e in sorted(header.entries.items(), key=lambda kv: kv[1].begin) if n != HASH_TABLE_NAME]
    return dict(zip(names, hashes))
