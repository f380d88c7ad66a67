"""`zeroshard verify`: is every byte of a checkpoint where the manifest says, and unchanged?

Checks, collecting every problem rather than stopping at the first: the manifest parses and is
structurally sound (types, bounds, names, layouts); every rank file is present with the recorded
size; each header agrees with the manifest (checkpoint id, rank, dtypes, shapes, the fragment
hash table); the whole-file hash matches; no stray rank files; with a key, the signature
(docs/SAFETY.md). Each file is read once, front to back, by one of `workers` threads (big files)
or processes (zeroshard.toolkit.workers).

What the hashes prove: the manifest's whole-file hash covers every byte of a file (its header
and hash table included), so a file that matches it is byte for byte what its writer committed.
Each fragment's hash in the file's own table is for readers of part of a file; checking those
too (`deep`) tests the writer's arithmetic, not the storage, and costs a hash call per fragment
(300,000 for a 1,000-rank checkpoint of 300 tensors). Remote files get the fragment check
anyway, since a second download would cost more than the hashing. A large local file is hashed
once, whole: a fragment pass costs as much CPU as the whole hash (xxh3 at ~10 GB/s against
page-cache reads at ~9 GB/s here). When anything is off, the file is checked again the slow way,
which names the tensor or header field at fault.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from zeroshard.errors import CheckpointError, StorageError, ZeroshardError
from zeroshard.format import resolve_checkpoint
from zeroshard.format.folder import read_manifest_bytes
from zeroshard.format.layouts import RankLayouts, layouts_of
from zeroshard.format.manifest import (
    HASH_TABLE_NAME,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    is_rank_file_name,
    parse_manifest,
)
from zeroshard.format.reader import chunk_bytes_for, read_hash_table, read_rank_header
from zeroshard.format.signature import MAX_SIGNATURE_BYTES, SIGNATURE_NAME, check_signature
from zeroshard.storage.hashing import SegmentHasher, hash_bytes, xxh3_int
from zeroshard.storage.location import Location
from zeroshard.storage.safetensors_header import Header
from zeroshard.toolkit.progress import byte_bar

SMALL_FILE_BYTES = 16 * 1024 * 1024


@dataclass
class VerifyReport:
    location: str
    problems: list[str] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    tensors: int = 0
    signed: bool = False  # a signature was checked and holds
    manifest_bytes: bytes = field(default=b"", repr=False)  # exactly the bytes checked
    sha256: dict[str, str] = field(default_factory=dict)  # per file, when asked for (signing)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(ckpt: str, *, storage_options: dict | None = None, quiet: bool = True, key: bytes | None = None,
           sha256: bool = False, workers: int | None = 1, deep: bool = False) -> VerifyReport:
    """key: also check the signature (format.signature) made with it; sha256: also record each
    file's SHA-256 (for signing); deep: also check every fragment against its file's hash table
    (see the module's docstring). Every file is still read once, by one of `workers` threads or processes
    (None: zeroshard.toolkit.workers.auto_workers)."""
    ckpt = os.fspath(ckpt)  # any os.PathLike
    if workers is not None and workers < 1:
        raise ZeroshardError(f"--workers must be at least 1, got {workers}")
    location = resolve_checkpoint(Location(ckpt, storage_options))
    report = VerifyReport(location.url)
    try:
        report.manifest_bytes = read_manifest_bytes(location)
        manifest = parse_manifest(report.manifest_bytes, location.url_of(MANIFEST_NAME))
        signed = None if key is None else _signed_digests(location, key, report.manifest_bytes)
    except (CheckpointError, StorageError) as exc:
        report.problems.append(str(exc))
        return report
    sha256 = sha256 or signed is not None
    report.tensors = len(manifest.tensors)
    present = set(location.list())
    for name in sorted(present - {f.name for f in manifest.files}):
        if is_rank_file_name(name):
            report.problems.append(f"{location.url_of(name)}: extra rank file not in {MANIFEST_NAME}")
    files = [f for f in manifest.files if f.name in present]
    report.problems.extend(f"{location.url_of(f.name)}: missing" for f in manifest.files if f.name not in present)
    total = sum(f.size for f in files)
    if workers is None:
        from zeroshard.toolkit.workers import auto_workers

        workers = auto_workers(0, total)  # by bytes: a small file costs less than a spawn
    with byte_bar(total, "verify", quiet) as bar:
        if workers == 1 or len(files) < 2:
            outcomes = [check_files(location.url, location.storage_options, manifest, files, sha256, bar.update,
                                    deep=deep, location=location)]
        else:
            from zeroshard.toolkit.workers import worker_pool

            groups = [files[i::workers * 4] for i in range(min(len(files), workers * 4))]
            with worker_pool(workers, [f.size for f in files]) as pool:
                futures = [pool.submit(check_files, location.url, location.storage_options, manifest, g, sha256,
                                       deep=deep) for g in groups]
                outcomes = []
                for future, group in zip(futures, groups):
                    outcomes.append(future.result())
                    bar.update(sum(f.size for f in group))
    for problems, checked, nbytes, digests in outcomes:
        report.problems.extend(problems)
        report.files_checked += checked
        report.bytes_checked += nbytes
        report.sha256.update(digests)
    if signed is not None:
        if set(signed) != {f.name for f in manifest.files}:
            report.problems.append(f"{location.url_of(SIGNATURE_NAME)}: signs other files than the manifest lists")
        for name, digest in report.sha256.items():
            if signed.get(name) != digest:
                report.problems.append(f"{location.url_of(name)}: SHA-256 differs from the signed one "
                                       "(changed after signing)")
        report.signed = not report.problems
    return report


def check_files(url: str, storage_options: dict, manifest: Manifest, files: list[FileEntry], sha256: bool = False,
                progress=None, *, deep: bool = False,
                location: Location | None = None) -> tuple[list[str], int, int, dict[str, str]]:
    """(problems, files checked, bytes checked, SHA-256 by file when asked) for some files."""
    location = location or Location(url, storage_options)
    layouts = layouts_of(manifest) if location.local else None
    buffer = bytearray(0)
    problems: list[str] = []
    checked = nbytes = 0
    digests: dict[str, str] = {}
    for file in files:
        try:
            fast = None
            if layouts is not None and file.size <= SMALL_FILE_BYTES:
                if len(buffer) < file.size:
                    buffer = bytearray(max(file.size, 2 * len(buffer)))
                fast = _check_small_file(location, file, manifest, layouts, buffer, deep, sha256)
            if fast is not None:  # everything holds
                found, digest = [], fast
                if progress is not None:
                    progress(file.size)
            else:  # large, remote, or something is off: the streaming check, which says what
                found, digest = _check_file(location, manifest, file, progress, sha256,
                                            fragments=deep or not location.local)
            problems.extend(f"{location.url_of(file.name)}: {p}" for p in found)
            if digest:
                digests[file.name] = digest
            checked += 1
            nbytes += file.size
        except (CheckpointError, StorageError) as exc:
            problems.append(str(exc))
    return problems, checked, nbytes, digests


def _signed_digests(location: Location, key: bytes, manifest_bytes: bytes) -> dict[str, str]:
    where = location.url_of(SIGNATURE_NAME)
    if not location.exists(SIGNATURE_NAME):
        raise CheckpointError(where, "missing: the checkpoint is not signed (zeroshard sign)")
    if location.is_link(SIGNATURE_NAME):
        raise CheckpointError(where, "is a symbolic link; a signature must be the checkpoint's own file")
    raw = location.read_bytes(SIGNATURE_NAME, 0, MAX_SIGNATURE_BYTES + 1)
    return check_signature(key, raw, manifest_bytes, where)


def _check_small_file(location: Location, file: FileEntry, manifest: Manifest, layouts: RankLayouts, buffer: bytearray,
                      deep: bool, sha256: bool) -> str | None:
    """A small local file read whole in one call and checked with one comparison (header) and
    one hash (every byte). Returns its SHA-256 ('' unless asked) when everything holds, None
    when anything does not or cannot be checked this way (a link, another size, a header
    composed otherwise, a hash mismatch): _check_file then checks it again and says what."""
    view = memoryview(buffer)[:file.size]
    if not location.read_whole_into(file.name, view):
        return None
    header = layouts.header(file.rank)
    # tobytes() first: a memoryview compares with bytes element by element, bytes by memcmp
    if file.size != layouts.file_size(file.rank, header) or view[:len(header)].tobytes() != header:
        return None
    if hash_bytes(view) != file.hash or (deep and not _fragments_hold(view, file, manifest, layouts, len(header))):
        return None
    return hashlib.sha256(view).hexdigest() if sha256 else ""


def _fragments_hold(view: memoryview, file: FileEntry, manifest: Manifest, layouts: RankLayouts, start: int) -> bool:
    """Every fragment's data against its recorded hash (the file's table, or a 1.0 manifest's)."""
    run = layouts.rank_layout(file.rank)
    ranges = [(layouts.tensors[i].name, start + b, start + b + n)
              for i, b, n in zip(run.tensors, run.begin, run.nbytes)]
    if manifest.legacy_hashes is None:
        table = view[start + run.table_begin:start + run.table_begin + 8 * len(ranges)]
        recorded = [int.from_bytes(table[8 * k:8 * k + 8], "little") for k in range(len(ranges))]
        return all(xxh3_int(view[b:e]) == h for (_, b, e), h in zip(ranges, recorded))
    legacy = manifest.legacy_hashes
    return all(hash_bytes(view[b:e]) == legacy[(name, file.rank)] for name, b, e in ranges)


def _check_file(location: Location, manifest: Manifest, file: FileEntry, progress,
                sha256: bool, fragments: bool = True) -> tuple[list[str], str]:
    """Problems of one file, and its SHA-256 when asked for ('' otherwise or when unread).

    fragments=False hashes the bytes once, whole (a local file: every fragment hash is a second
    pass over every byte, as much CPU as the whole hash); only when that hash is off is the file
    read again with every fragment's hash, to name the tensors at fault."""
    size = location.size(file.name)
    if size != file.size:
        problem = "truncated" if size < file.size else "longer than recorded"
        return [f"file is {problem}: {size} bytes, manifest records {file.size}"], ""
    with location.open_reader(file.name, size=size) as reader:
        header, problems = read_rank_header(reader, file, manifest, size)
        if problems:
            return problems, ""
        if manifest.legacy_hashes is None:
            expected = read_hash_table(reader, header)
        else:
            expected = {name: manifest.legacy_hashes[(name, file.rank)] for name in header.entries}
        strong = hashlib.sha256() if sha256 else None
        chunk = chunk_bytes_for(location)
        file_hash, tensor_hashes = _hash_file(reader, header, size, chunk, progress, strong, fragments)
        if file_hash != file.hash and not fragments:
            file_hash, tensor_hashes = _hash_file(reader, header, size, chunk, None, None)
    if file_hash != file.hash:
        problems.append("content hash mismatch (file corrupt or modified)")
    for name, digest in tensor_hashes.items():
        if name != HASH_TABLE_NAME and expected.get(name) != digest:
            problems.append(f"tensor {name!r}: content hash mismatch")
    return problems, strong.hexdigest() if strong is not None else ""


def _hash_file(reader, header: Header, size: int, chunk: int, progress, strong=None,
               fragments: bool = True) -> tuple[str, dict[str, str]]:
    """Hash the whole file and (fragments) each tensor's bytes in one sequential pass."""
    view = reader.view(0, size) if size <= SMALL_FILE_BYTES else None
    if view is not None:  # a small local file (the 1,000-rank case): one call per hash, no stream
        hashes = {n: hash_bytes(view[e.begin:e.end]) for n, e in header.entries.items()} if fragments else {}
        whole = hash_bytes(view)
        if strong is not None:
            strong.update(view)
        del view
        if progress is not None:
            progress(size)
        return whole, hashes
    hasher = SegmentHasher([(e.begin, e.end, n) for n, e in header.entries.items()] if fragments else [])
    buffer = None
    for offset in range(0, size, chunk):
        length = min(chunk, size - offset)
        view = reader.view(offset, length)  # zero-copy locally
        if view is None:
            buffer = buffer or memoryview(bytearray(min(chunk, size)))
            view = buffer[:length]
            reader.read_into(offset, view)
        hasher.update(view)
        if strong is not None:
            strong.update(view)
        del view
        reader.release(offset, length)
        if progress is not None:
            progress(length)
    return hasher.hexdigest, hasher.segment_hashes
