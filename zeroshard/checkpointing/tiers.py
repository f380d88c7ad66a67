"""Checkpoint tiers: what is saved where and how often, said in one place (issue 26).

    from zeroshard.checkpointing import TierPolicy
    ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy(memory_every=10, durable_every=100))  # defaults
    for step in ...:
        train_step()
        ckpt.checkpoint("s3://bucket/run", client_state={"next_step": step + 1})  # does what is due
    client_state = ckpt.load("s3://bucket/run")    # newest verified memory checkpoint, else durable

The memory tier is a folder per node on tmpfs (`<memory_dir>/<node>`), holding complete format
1.1 checkpoints (rank files, hashes, manifest last), each rank file also copied to `replicas`
other nodes (replicas.py). A durable checkpoint is, by default, *drained* from the memory tier in
the background: the rank files are copied from tmpfs to the durable root and committed there
manifest-last like any save, so the engine is snapshotted once per step however many tiers
get it. See docs/RECOVERY.md.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from zeroshard.errors import ConfigError
from zeroshard.format.manifest import is_safe_file_name
from zeroshard.storage.owner import job_run_id

DEFAULT_MEMORY_PARENT = "/dev/shm"
DOMAIN_ENV = "ZEROSHARD_DOMAIN"  # a node's failure domain (rack), set per node by the launcher


@dataclass(frozen=True)
class TierPolicy:
    """Where and how often checkpoints go.

    job: the job the memory tier belongs to, the same in every incarnation of it (a relaunch after
      a lost node recovers only what its own job saved). None: torchrun's run id (`--rdzv-id`);
      without either the memory tier is refused, since jobs could not be told apart.
    memory_dir: the memory tier's root on tmpfs; each node keeps its folder `<memory_dir>/<node>`
      (node: ZEROSHARD_HOST_ID or the host name). Default /dev/shm/zeroshard-<job>. A node's
      folder belongs to the first job that saves into it (memory_tier.MemoryFolder.claim).
    memory_every / durable_every: `Checkpointer.checkpoint()` saves to memory when the step is a
      multiple of memory_every, to the durable root when a multiple of durable_every (0: never).
    drain: a durable checkpoint is copied from the memory checkpoint of the same step in the
      background (True), or written from the engine like a plain async save (False).
    memory_keep_last: committed memory checkpoints a node keeps, the one being written included
      (so at most this many are ever on tmpfs; with 1, a kill during a save leaves none).
    durable_keep_last: as Checkpointer.save's keep_last for the durable root (None: keep all).
    memory_cap_bytes: the most a node's memory folder may hold; None: the tmpfs's free space,
      less `min_free_fraction` of the tmpfs left for everything else on the node.
    replicas: other nodes holding a copy of each rank file (0: none; at most nodes - 1 are used).
    domain: this node's failure domain (a rack, a power zone), spanning one node or several:
      copies go to nodes of other domains first. None: ZEROSHARD_DOMAIN, else the node itself.
    """

    job: str | None = None
    memory_dir: str | None = None
    memory_every: int = 10
    durable_every: int = 100
    drain: bool = True
    memory_keep_last: int = 2
    durable_keep_last: int | None = None
    memory_cap_bytes: int | None = None
    min_free_fraction: float = 0.1
    replicas: int = 1
    domain: str | None = None

    def __post_init__(self) -> None:
        for name in ("memory_every", "durable_every", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"TierPolicy.{name} must be a count (0 or more), not {value!r}")
        if self.memory_every < 1:
            raise ConfigError("TierPolicy.memory_every must be at least 1")
        if self.memory_keep_last < 1:
            raise ConfigError("TierPolicy.memory_keep_last must be at least 1")
        if self.durable_keep_last is not None and self.durable_keep_last < 1:
            raise ConfigError("TierPolicy.durable_keep_last must be at least 1 (or None)")
        if self.memory_cap_bytes is not None and self.memory_cap_bytes < 1:
            raise ConfigError("TierPolicy.memory_cap_bytes must be positive (or None)")
        if not 0.0 <= self.min_free_fraction < 1.0:
            raise ConfigError("TierPolicy.min_free_fraction must be in [0, 1)")
        if self.memory_dir is not None and "://" in str(self.memory_dir):
            raise ConfigError(f"TierPolicy.memory_dir {self.memory_dir!r} must be a local folder (tmpfs), not a URL")
        if self.job is not None and (not isinstance(self.job, str) or not self.job.strip()):
            raise ConfigError(f"TierPolicy.job must be a non-empty name, not {self.job!r}")

    def domain_name(self, node: str) -> str:
        """This node's failure domain (`node`: its name, the default when no domain is set)."""
        return self.domain or os.environ.get(DOMAIN_ENV) or node

    def named_job(self) -> str | None:
        """The job this process's memory tier belongs to: `job`, else torchrun's run id; None
        when neither names it."""
        return self.job or job_run_id()

    def job_name(self) -> str:
        """named_job(), refused (ConfigError) when None: two jobs on one node would share a
        folder, and one job's recovery or pruning could take or delete the other's checkpoints."""
        name = self.named_job()
        if name is None:
            raise ConfigError("the memory tier needs to know which job it belongs to: launch with torchrun "
                              "--rdzv-id <id> (the same id when the job is relaunched) or set TierPolicy(job=...)")
        return name

    def root(self) -> str:
        """The memory tier's root (not yet the node's folder)."""
        if self.memory_dir is not None:
            return os.fspath(self.memory_dir)
        return os.path.join(DEFAULT_MEMORY_PARENT, f"zeroshard-{job_folder_name(self.job_name())}")

    def due(self, step: int) -> tuple[bool, bool]:
        """(memory, durable): which tiers a checkpoint at `step` goes to."""
        durable = self.durable_every > 0 and step % self.durable_every == 0
        return step % self.memory_every == 0 or (durable and self.drain), durable


def job_folder_name(job: str) -> str:
    """`job` as a folder name: itself when it is a plain short name, else a digest of it."""
    if is_safe_file_name(job) and len(job) <= 100:
        return job
    return "job-" + hashlib.sha256(job.encode()).hexdigest()[:16]
