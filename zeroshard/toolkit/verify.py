"""`zeroshard verify`: is every byte of a checkpoint where the manifest says, and unchanged?

Checks, collecting every problem rather than stopping at the first: the manifest parses and is
structurally sound (fragments tile each tensor exactly once, partition rule, names); every rank
file is present with the recorded size; each header agrees with the manifest (checkpoint id,
rank, dtypes, shapes); the whole-file hash and every fragment hash match; no stray rank files.
Each file is read once, front to back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from zeroshard.errors import CheckpointError, StorageError
from zeroshard.format import check_header, resolve_checkpoint
from zeroshard.format.manifest import MANIFEST_NAME, FileEntry, Manifest, is_rank_file_name, parse_manifest
from zeroshard.format.signature import MAX_SIGNATURE_BYTES, SIGNATURE_NAME, check_signature
from zeroshard.format.reader import chunk_bytes_for
from zeroshard.storage.hashing import SegmentHasher
from zeroshard.storage.location import Location
from zeroshard.storage.safetensors_header import Header, read_header
from zeroshard.toolkit.progress import byte_bar



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
           sha256: bool = False) -> VerifyReport:
    """key: also check the signature (format.signature) made with it; sha256: also record each
    file's SHA-256 (for signing). Every file is still read once."""
    location = resolve_checkpoint(Location(ckpt, storage_options))
    report = VerifyReport(location.url)
    try:
        report.manifest_bytes = location.read_bytes(MANIFEST_NAME)
        manifest = parse_manifest(report.manifest_bytes, location.url_of(MANIFEST_NAME))
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    signed: dict[str, str] | None = None
    if key is not None:
        try:
            signed = _signed_digests(location, key, report.manifest_bytes)
        except (CheckpointError, StorageError) as exc:
            report.problems.append(str(exc))
            return report
    sha256 = sha256 or signed is not None
    report.tensors = len(manifest.tensors)
    present = set(location.list())
    for name in sorted(present - {f.name for f in manifest.files}):
        if is_rank_file_name(name):
            report.problems.append(f"{location.url_of(name)}: extra rank file not in {MANIFEST_NAME}")
    total = sum(f.size for f in manifest.files if f.name in present)
    with byte_bar(total, "verify", quiet) as bar:
        for file in manifest.files:
            where = location.url_of(file.name)
            if file.name not in present:
                report.problems.append(f"{where}: missing")
                continue
            try:
                problems, digest = _check_file(location, manifest, file, bar, sha256)
                report.problems.extend(f"{where}: {p}" for p in problems)
                if digest:
                    report.sha256[file.name] = digest
                report.files_checked += 1
                report.bytes_checked += file.size
            except (CheckpointError, StorageError) as exc:
                report.problems.append(str(exc))
    if signed is not None:
        where = location.url_of(SIGNATURE_NAME)
        if set(signed) != {f.name for f in manifest.files}:
            report.problems.append(f"{where}: signs other files than the manifest lists")
        for name, digest in report.sha256.items():
            if signed.get(name) != digest:
                report.problems.append(f"{location.url_of(name)}: SHA-256 differs from the signed one (changed after signing)")
        report.signed = not report.problems
    return report


def _signed_digests(location: Location, key: bytes, manifest_bytes: bytes) -> dict[str, str]:
    where = location.url_of(SIGNATURE_NAME)
    if not location.exists(SIGNATURE_NAME):
        raise CheckpointError(where, "missing: the checkpoint is not signed (zeroshard sign)")
    if location.is_link(SIGNATURE_NAME):
        raise CheckpointError(where, "is a symbolic link; a signature must be the checkpoint's own file")
    raw = location.read_bytes(SIGNATURE_NAME, 0, MAX_SIGNATURE_BYTES + 1)
    return check_signature(key, raw, manifest_bytes, where)


def _check_file(location: Location, manifest: Manifest, file: FileEntry, bar, sha256: bool) -> tuple[list[str], str]:
    """Problems of one file, and its SHA-256 when asked for ('' otherwise or when unread)."""
    size = location.size(file.name)
    if size != file.size:
        problem = "truncated" if size < file.size else "longer than recorded"
        return [f"file is {problem}: {size} bytes, manifest records {file.size}"], ""
    with location.open_reader(file.name) as reader:
        header = read_header(reader, size)
        problems = check_header(header, file, manifest)
        if problems:
            return problems, ""
        expected = {t.name: f.hash for t in manifest.tensors.values() for f in t.fragments if f.rank == file.rank}
        strong = hashlib.sha256() if sha256 else None
        file_hash, tensor_hashes = _hash_file(reader, header, size, chunk_bytes_for(location), bar, strong)
    if file_hash != file.hash:
        problems.append("content hash mismatch (file corrupt or modified)")
    for name, digest in tensor_hashes.items():
        if expected.get(name) != digest:
            problems.append(f"tensor {name!r}: content hash mismatch")
    return problems, strong.hexdigest() if strong is not None else ""


def _hash_file(reader, header: Header, size: int, chunk: int, bar, strong=None) -> tuple[str, dict[str, str]]:
    """Hash the whole file and each tensor's bytes in one sequential pass."""
    hasher = SegmentHasher([(e.begin, e.end, n) for n, e in header.entries.items()])
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
        bar.update(length)
    return hasher.hexdigest, hasher.segment_hashes
