"""The memory tier: a node's folder on tmpfs holding complete format 1.1 checkpoints (issue 26).

A node's folder (`<memory_dir>/<node>`) looks like any checkpoint root: one folder per tag with
rank files and a manifest written last, and `latest`; `zeroshard inspect | verify | reshard`
read it unchanged. A node holds the files of its own ranks plus the replicas it keeps for other
nodes (replicas.py); with two nodes and one replica each node's folder is complete.

The save (`write_memory_checkpoint`, on the Checkpointer's gloo group, normally on its
background thread after the copy-on-write snapshot):
  1. each node's lead rank (its lowest) removes the folders the save will replace: the same tag,
     torn saves (no manifest), committed checkpoints beyond memory_keep_last - 1;
  2. every rank writes its own file; the ranks agree on the results;
  3. the replicas travel (replicas.py) and are checked against the writer's file hash; agreed;
  4. each node's lead writes the manifest (the same bytes on every node) and moves `latest`.
A save that would not fit is refused by `check_fits` before step 1, on the training thread.

[Note: one job per folder] Two jobs on one node with the same memory_dir would otherwise share a
folder: tags collide (both save step-00000010), one job's pruning deletes the other's checkpoints
and its recovery may load them. So a node's folder belongs to one job: the first save claims it
(`OWNER_NAME`, created exclusively, holding the job's name), a save by another job is refused
before anything is written, and recovery skips a folder or manifest of another job with a reason.
Every memory manifest also records its job (`extra["memory_tier"]["job"]`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from zeroshard.checkpointing.replicas import Landing, lead_of, map_file, replica_targets, run_transfers
from zeroshard.checkpointing.save import SaveJob, agree_on_save
from zeroshard.errors import CheckpointError, CheckpointSaveError, StorageError
from zeroshard.format import build_manifest, commit_checkpoint, rank_contents, update_latest, write_rank_file
from zeroshard.format.folder import load_manifest
from zeroshard.format.manifest import MANIFEST_NAME, Manifest, is_safe_file_name, rank_file_name
from zeroshard.format.writer import TensorSpec, rank_file_layout, rank_metadata
from zeroshard.storage import Location
from zeroshard.storage.hashing import new_hasher
from zeroshard.storage.safetensors_header import build_header

HASH_CHUNK = 16 << 20
OWNER_NAME = "job.json"  # in a node's folder: the job it belongs to (see [Note: one job per folder])
OWNER_MAX_BYTES = 4096


def job_of(manifest: Manifest) -> str | None:
    """The job a memory manifest was written by; None when it records none."""
    tier = (manifest.extra or {}).get("memory_tier")
    job = tier.get("job") if isinstance(tier, dict) else None
    return job if isinstance(job, str) else None


@dataclass
class Committed:
    """A committed checkpoint in a node's folder."""

    tag: str
    manifest: Manifest
    nbytes: int


class MemoryFolder:
    """One node's folder of the memory tier."""

    def __init__(self, root: str, node: str, job: str) -> None:
        if not is_safe_file_name(node):
            raise CheckpointSaveError(f"{root}: node name {node!r} cannot name a folder (set ZEROSHARD_HOST_ID)")
        self.path = os.path.join(root, node)
        self.location = Location(self.path)
        self.job = job
        self._parsed: dict[tuple, Manifest] = {}

    def owner(self) -> str | None:
        """The job this folder belongs to; None when no job has claimed it yet. A folder whose
        owner file cannot be read as a job's name is reported as owned by '<unreadable ...>', so
        it is never taken for this job's."""
        for _ in range(20):
            if not self.location.exists(OWNER_NAME):
                return None
            try:
                data = self.location.read_bytes(OWNER_NAME, 0, OWNER_MAX_BYTES + 1)
            except StorageError:
                return None  # removed meanwhile
            if data:
                break
            time.sleep(0.05)  # a claim in flight: created, not yet written (only where no hard links)
        try:
            job = json.loads(data)["job"] if len(data) <= OWNER_MAX_BYTES else None
        except (ValueError, TypeError, KeyError):
            job = None
        return job if isinstance(job, str) else f"<unreadable {self.location.url_of(OWNER_NAME)}>"

    def foreign_owner(self) -> str | None:
        """The other job this folder belongs to; None when it is this job's or nobody's."""
        owner = self.owner()
        return owner if owner not in (None, self.job) else None

    def claim(self) -> None:
        """Make this folder this job's, or refuse (CheckpointSaveError, one line) when another
        job's: see [Note: one job per folder]. Safe to call from every rank of a node at once."""
        self.location.create_exclusive(OWNER_NAME, json.dumps({"job": self.job}).encode())
        self.check_owner()  # created here, or by this job or another job before

    def check_owner(self) -> None:
        """Refuse (CheckpointSaveError, one line) a folder that belongs to another job."""
        other = self.foreign_owner()
        if other is not None:
            raise CheckpointSaveError(
                f"{self.path}: memory folder belongs to job {other!r}, not to this job {self.job!r}; nothing "
                f"written. Give each job its own TierPolicy.memory_dir, keep the job's name across relaunches "
                f"(TierPolicy.job or torchrun --rdzv-id), or remove the folder once job {other!r} is over")

    def tag_folder(self, tag: str) -> Location:
        return self.location.child(tag)

    def scan(self) -> tuple[list[Committed], list[str], list[str]]:
        """(committed checkpoints oldest first, torn tags, problems): a folder without a manifest
        is a save that never committed; an unreadable manifest is reported, never chosen."""
        committed, torn, problems = [], [], []
        if not os.path.isdir(self.path):
            return committed, torn, problems
        for name in sorted(os.listdir(self.path)):
            folder = os.path.join(self.path, name)
            if not is_safe_file_name(name) or os.path.islink(folder) or not os.path.isdir(folder):
                continue
            if not os.path.exists(os.path.join(folder, MANIFEST_NAME)):
                torn.append(name)
                continue
            try:
                manifest = self._manifest(name, os.stat(os.path.join(folder, MANIFEST_NAME)))
            except (CheckpointError, OSError) as exc:
                problems.append(str(exc))
                continue
            committed.append(Committed(name, manifest, _folder_bytes(folder)))
        committed.sort(key=lambda c: (c.manifest.step or 0, c.tag))
        return committed, torn, problems

    def _manifest(self, tag: str, stat: os.stat_result) -> Manifest:
        """A manifest parsed once per version of its file: every save scans the folder, and
        parsing a large model's manifest again each time would add to what training waits for."""
        key = (tag, stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if key not in self._parsed:
            self._parsed = {k: v for k, v in self._parsed.items() if k[0] != tag}
            self._parsed[key] = load_manifest(self.location.child(tag))
        return self._parsed[key]

    def doomed(self, tag: str, keep_last: int) -> tuple[list[str], list[Committed]]:
        """(folders a save of `tag` removes first, committed checkpoints it keeps). Torn folders
        are this job's (the folder is: `claim`); a committed checkpoint of another job is never
        removed or counted."""
        committed, torn, _ = self.scan()
        theirs = next((c for c in committed if c.tag == tag and job_of(c.manifest) != self.job), None)
        if theirs is not None:
            raise CheckpointSaveError(f"{self.path}/{tag}: a memory checkpoint of job {job_of(theirs.manifest)!r} is "
                                      f"there, not one of this job {self.job!r}; nothing written")
        committed = [c for c in committed if job_of(c.manifest) == self.job]
        others = [c for c in committed if c.tag != tag]
        keep = others[len(others) - (keep_last - 1):] if keep_last > 1 else []
        kept = {c.tag for c in keep}
        doomed = torn + [c.tag for c in committed if c.tag not in kept]
        return sorted(set(doomed)), keep

    def remove(self, tag: str) -> None:
        """Un-commit first (manifest), then the rest: a half-removed folder never looks complete."""
        folder = self.tag_folder(tag)
        folder.remove(MANIFEST_NAME)
        self.location.remove(tag, recursive=True)

    def verified_ranks(self, tag: str, files: Sequence[tuple[int, str, int, str]], hashes: bool = False) -> list[int]:
        """The ranks whose file (rank, name, size, hash) is in `tag` with that size (and, with
        `hashes`, that whole-file hash: off for recovery, whose reads check every fragment's hash
        anyway, a failure falling back to the durable tier)."""
        held = []
        for rank, name, size, digest in files:
            path = os.path.join(self.path, tag, name)
            try:
                if os.path.isfile(path) and not os.path.islink(path) and os.path.getsize(path) == size \
                        and (not hashes or file_hash(path) == digest):
                    held.append(rank)
            except (OSError, StorageError):
                continue  # vanished or unreadable: not held
        return held


def _folder_bytes(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full) and not os.path.islink(full):
            total += os.path.getsize(full)
    return total


def file_hash(path: str) -> str:
    """The whole-file XXH3-64 the manifest records (FileEntry.hash)."""
    folder, name = os.path.split(path)
    hasher = new_hasher()
    reader = Location(folder or ".").open_reader(name)
    try:
        offset, size = 0, os.path.getsize(path)
        while offset < size:
            chunk = reader.read(offset, min(HASH_CHUNK, size - offset))
            if not chunk:
                break
            hasher.update(chunk)
            offset += len(chunk)
    finally:
        reader.close()
    return hasher.hexdigest()


def rank_file_size(specs: list[TensorSpec], world_size: int, rank: int) -> int:
    """The exact size of rank `rank`'s file, known before a byte is written."""
    layout = rank_file_layout(rank_contents(specs, world_size, rank))
    header, entries = build_header(layout, rank_metadata("0" * 32, rank, world_size))
    return max((e.end for e in entries.values()), default=len(header))


def check_fits(folder: MemoryFolder, tag: str, keep_last: int, new_bytes: int, cap: int | None,
               min_free_fraction: float) -> None:
    """Refuse (CheckpointSaveError, one line) a save of `new_bytes` into this node's folder that
    would not fit on the tmpfs (less the share left free for the node) or under `cap`."""
    doomed, kept = folder.doomed(tag, keep_last)
    paths = [os.path.join(folder.path, t) for t in doomed]
    freed = sum(_folder_bytes(p) for p in paths if os.path.isdir(p))
    kept_bytes = sum(c.nbytes for c in kept)
    probe = folder.path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    st = os.statvfs(probe)
    usable = st.f_bavail * st.f_frsize + freed - int(min_free_fraction * st.f_blocks * st.f_frsize)
    mb = 1 << 20
    if new_bytes > usable:
        raise CheckpointSaveError(
            f"{folder.path}: memory checkpoint {tag} refused, nothing written: this node's {new_bytes / mb:.1f} MiB "
            f"would not fit in the {max(usable, 0) / mb:.1f} MiB the tmpfs can spare (keeping "
            f"{min_free_fraction:.0%} of it free); lower memory_keep_last or use a larger tmpfs")
    if cap is not None and kept_bytes + new_bytes > cap:
        raise CheckpointSaveError(
            f"{folder.path}: memory checkpoint {tag} refused, nothing written: {kept_bytes / mb:.1f} MiB kept + "
            f"{new_bytes / mb:.1f} MiB new is over memory_cap_bytes ({cap / mb:.1f} MiB); lower memory_keep_last "
            f"or raise the cap")


def node_bytes(specs: list[TensorSpec], world_size: int, hosts: list[str], replicas: int, me: int,
               domains: list[str] | None = None) -> int:
    """What this save puts into the folder of rank `me`'s node: its ranks' files and replicas."""
    mine = hosts[me]
    targets = replica_targets(hosts, replicas, domains)
    ranks = {r for r in range(world_size) if hosts[r] == mine}
    ranks |= {r for r, dsts in targets.items() if any(hosts[d] == mine for d in dsts)}
    return sum(rank_file_size(specs, world_size, r) for r in ranks)


def write_memory_checkpoint(job: SaveJob, folder: MemoryFolder, hosts: list[str], replicas: int, keep_last: int,
                            group: Any, domains: list[str] | None = None) -> Manifest:
    """Steps 1 to 4 above (collective on `group`). Returns the committed manifest."""
    lead = lead_of(hosts, job.rank) == job.rank
    target = folder.tag_folder(job.tag)
    error = None
    if lead:
        try:
            for tag in folder.doomed(job.tag, keep_last)[0]:
                folder.remove(tag)
            target.makedirs()
        except Exception as exc:
            error = exc
    agree_on_save(error, group, None)
    specs = job.contents.specs
    try:
        target.makedirs()
        result = write_rank_file(target, job.checkpoint_id, job.rank, job.world_size,
                                 rank_contents(specs, job.world_size, job.rank), job.fill,
                                 write_behind=job.write_behind)
        error = None
    except Exception as exc:
        result, error = None, CheckpointSaveError(f"{target.url}: memory save failed, nothing committed: "
                                                  f"rank {job.rank}: {exc}")
    rank0 = (dict(job.contents.manifest_fields), job.manifest_extra, job.client_state) if job.rank == 0 else None
    everyone = agree_on_save(error, group, (result, rank0))
    results = [r for r, _ in everyone]
    fields, extra, client_state = everyone[0][1]

    def read(name: str) -> torch.Tensor:
        return map_file(os.path.join(target.path, name))

    def check(name: str, size: int, digest: str, rank: int) -> None:
        if (size, digest) != (results[rank].file.size, results[rank].file.hash):  # checked before it lands
            raise StorageError(target.url_of(name), "replica's hash differs from the one its rank wrote")

    plan = [(rank_file_name(r, job.world_size), r, r, d)
            for r, dsts in sorted(replica_targets(hosts, replicas, domains).items()) for d in dsts]
    error = run_transfers(plan, job.rank, read, check, group, Landing(target.path))
    agree_on_save(error, group, None)
    fields["extra"] = {**fields.get("extra", {}), **extra, "memory_tier": {"job": folder.job}}
    manifest = build_manifest(specs, job.world_size, results, job.checkpoint_id, tag=job.tag,
                              client_state=client_state, **fields)
    error = None
    if lead:
        try:
            commit_checkpoint(target, manifest)
            update_latest(folder.location, job.tag)
        except Exception as exc:
            error = exc
    agree_on_save(error, group, None)
    return manifest
