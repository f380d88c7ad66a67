"""Checkpoint format 1.1 (docs/FORMAT.md; 1.0 read too): manifest, rank files, commit, reading and writing.

Shared by the toolkit and the training core; built on zeroshard.storage and zeroshard.partition.
"""

from zeroshard.format.folder import (
    OpenedCheckpoint,
    commit_checkpoint,
    load_manifest,
    open_checkpoint,
    opened_checkpoint,
    resolve_checkpoint,
    update_latest,
)
from zeroshard.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HASH_TABLE_NAME,
    LATEST_NAME,
    MANIFEST_NAME,
    FileEntry,
    Fragment,
    Manifest,
    TensorEntry,
    check_manifest,
    owned_range,
    parse_manifest,
    rank_contents,
    rank_file_name,
)
from zeroshard.format.reader import CheckpointReader, check_header
from zeroshard.format.writer import RankFileResult, TensorSpec, build_manifest, write_rank_file

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "LATEST_NAME", "MANIFEST_NAME", "CheckpointReader", "FileEntry", "Fragment",
    "HASH_TABLE_NAME", "Manifest", "OpenedCheckpoint", "RankFileResult", "TensorEntry", "TensorSpec", "build_manifest",
    "check_header", "check_manifest",
    "commit_checkpoint", "load_manifest", "open_checkpoint", "opened_checkpoint", "owned_range", "parse_manifest",
    "rank_contents", "rank_file_name", "resolve_checkpoint", "update_latest", "write_rank_file",
]
