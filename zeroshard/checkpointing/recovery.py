"""Recovery that picks the best tier (issue 26): the newest memory checkpoint every rank can get
a verified copy of its file of (from its own node, else a peer's), else the durable root.

    1. each node's lead lists its committed memory checkpoints (and torn ones); rank 0 reads the
       durable root's newest step; one all-gather;
    2. each lead lists the files its folder holds for every candidate (present, of the size the
       manifest gives); one all-gather. Hashes are checked as the files are read (every fragment)
       and, for a copy fetched from a peer, whole on arrival;
    3. `choose` (the same answer on every rank): newest candidate first, skipped with a reason
       if some rank's file has no verified copy on any node
       (lost with its node, or torn), or if the durable root holds a newer step;
    4. a node missing files it needs (its ranks' files, rank 0's for buffers, the replicas it
       keeps) or the manifest fetches them from a node that holds them (replicas.run_transfers):
       what the load reads and the manifest (last) first; then every rank loads from its own
       node's folder; then, on the Checkpointer's background thread while training goes on, the
       replicas the node keeps, so every file has its copies once more;
    5. one log line (logger zeroshard.checkpointing.recovery, INFO) says which tier and step,
       and why the others were skipped. A failure of the memory path that all ranks agree on
       (a file that fails its hash as it is read) falls back to the durable root, said in that line.
At another world size (a node lost, the job going on with fewer ranks) each node gathers every
file of the chosen checkpoint it lacks from the surviving copies (local, else a peer's, over the
job's gloo group), and the load reads the ranges each new rank owns from that folder, as it does
from any folder at any world size: no round trip through durable storage. Gathering whole files
rather than only the overlapping ranges keeps one load path and leaves a complete checkpoint on
the node that the toolkit reads too; with two nodes and one replica the survivor already holds
every file, so nothing moves. Nothing here ever writes to the durable root.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zeroshard.agree import agree
from zeroshard.checkpointing.memory_tier import MemoryFolder, job_of
from zeroshard.checkpointing.replicas import Landing, lead_of, map_file, node_map, replica_targets, run_transfers
from zeroshard.errors import PeerLostError, StorageError, ZeroshardError
from zeroshard.format import open_checkpoint
from zeroshard.format.folder import update_latest
from zeroshard.format.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)
ACTION = "recovery from the memory tier"


@dataclass(frozen=True)
class Candidate:
    """A committed memory checkpoint as one node's manifest describes it."""

    id: str
    tag: str
    step: int
    world_size: int
    files: tuple[tuple[int, str, int, str], ...]  # (rank, name, size, hash)
    buffers: bool


@dataclass
class Choice:
    candidate: Candidate | None
    holders: dict[int, list[int]] = field(default_factory=dict)  # file rank -> nodes holding it verified
    skipped: list[str] = field(default_factory=list)


def candidates_of(folder: MemoryFolder) -> tuple[list[Candidate], list[str]]:
    """This node's committed memory checkpoints of this job, and notes on the others: torn,
    unreadable, or another job's (see [Note: one job per folder] in memory_tier.py)."""
    committed, torn, problems = folder.scan()
    out, notes = [], [f"{t} torn (no manifest)" for t in torn] + problems
    for c in committed:
        job = job_of(c.manifest)
        if job != folder.job:
            notes.append(f"{c.tag} " + (f"is job {job!r}'s" if job else "records no job"))
            continue
        out.append(Candidate(c.manifest.id, c.tag, c.manifest.step or 0, c.manifest.world_size,
                             tuple((f.rank, f.name, f.size, f.hash) for f in c.manifest.files),
                             any(t.role == "buffer" for t in c.manifest.tensors.values())))
    return out, notes


def choose(found: list[list[Candidate]], held: list[dict[str, list[int]]], world_size: int,
           durable_step: int | None) -> Choice:
    """Pick the memory checkpoint to recover from. `found[n]` / `held[n]`: node n's committed
    candidates and, by candidate id, the ranks whose files it holds verified."""
    by_id: dict[str, Candidate] = {}
    for node in found:
        for c in node:
            by_id.setdefault(c.id, c)
    skipped: list[str] = []
    for c in sorted(by_id.values(), key=lambda c: (c.step, c.tag), reverse=True):
        if durable_step is not None and durable_step > c.step:
            skipped.append(f"{c.tag} older than the durable step {durable_step}")
            continue
        # any world size: the load reads by range (load.py), so the old files are all it needs
        holders = {r: [n for n, h in enumerate(held) if r in h.get(c.id, [])] for r in range(c.world_size)}
        lost = [r for r, nodes in holders.items() if not nodes]
        if lost:
            skipped.append(f"{c.tag} has no verified copy of the file(s) of rank(s) {', '.join(map(str, lost))}")
            continue
        return Choice(c, holders, skipped)
    return Choice(None, {}, skipped)


def fetch_plan(choice: Choice, nodes: list[list[int]], have_manifest: list[bool],
               keeps: dict[int, list[int]] | None = None) -> list[tuple[str, int, int, int]]:
    """Transfers (name, file rank, source rank, destination rank) that give every node the files
    its ranks read (theirs, rank 0's for buffers), the replicas it keeps (`keeps`: file rank ->
    ranks keeping a copy, replicas.replica_targets: so the job is protected again at once) and
    the manifest, the manifest last."""
    c = choice.candidate
    assert c is not None
    names = {rank: name for rank, name, _, _ in c.files}
    resharding = c.world_size != sum(len(ranks) for ranks in nodes)
    plan, manifests = [], []
    for n, ranks in enumerate(nodes):
        # at another world size a new rank's ranges span old files: the node gathers them all
        # (then its folder is a whole checkpoint, which the load reads by range, as the toolkit can)
        needed = set(range(c.world_size)) if resharding else set(ranks) | ({0} if c.buffers else set())
        needed |= {r for r, dsts in (keeps or {}).items() if set(dsts) & set(ranks)}
        for r in sorted(needed):
            if n not in choice.holders[r]:
                src = nodes[sorted(choice.holders[r], key=lambda m: (r not in nodes[m], m))[0]][0]
                plan.append((names[r], r, src, ranks[0]))
        if not have_manifest[n]:
            src_node = next(m for m, has in enumerate(have_manifest) if has)
            manifests.append((MANIFEST_NAME, -1, nodes[src_node][0], ranks[0]))
    return plan + manifests


def recover(rank: int, world_size: int, group: Any, folder: MemoryFolder, hosts: list[str], replicas: int,
            durable: str | None, storage_options: dict | None, load: Callable[[str, dict | None], Any],
            domains: list[str] | None = None) -> tuple[Any, str, Callable[[], None] | None]:
    """Load from the best tier with `load(path, storage_options)` (collective); returns its result,
    the log line, and what is left to restore the replicas (for the caller's background thread)."""
    lead = lead_of(hosts, rank) == rank
    nodes = node_map(hosts)
    error = None
    mine: tuple[list[Candidate], list[str]] = ([], [])
    durable_step = foreign = None
    try:
        if lead:
            owner = folder.foreign_owner()
            foreign = None if owner is None else f"{folder.path} belongs to job {owner!r}"
            mine = candidates_of(folder) if owner is None else mine
        if rank == 0 and durable is not None:
            durable_step = _durable_step(durable, storage_options)
    except Exception as exc:
        error = exc
    everyone = agree(error, group, action=ACTION, payload=(mine, durable_step, foreign))
    leads = [ranks[0] for ranks in nodes]
    found = [everyone[r][0][0] for r in leads]
    notes = [f"{hosts[r]}: {note}" for r in leads for note in everyone[r][0][1]]
    durable_step = everyone[0][1]
    # a node whose folder is another job's cannot take part: nothing is read from it or written to it
    taken = [f"{hosts[r]}: {everyone[r][2]}, not this job {folder.job!r}" for r in leads if everyone[r][2]]
    if taken:
        found, notes = [[] for _ in leads], taken + notes
    wanted = {c.id: c for node in found for c in node}
    try:
        held = {cid: folder.verified_ranks(c.tag, c.files) for cid, c in wanted.items()} if lead else {}
    except Exception as exc:
        error, held = exc, {}
    gathered = agree(error, group, action=ACTION, payload=held)
    choice = choose(found, [gathered[r] for r in leads], world_size, durable_step)
    skipped = "; ".join(choice.skipped + notes) or "nothing"
    c = choice.candidate
    if c is not None:
        try:
            keeps = replica_targets(hosts, replicas, domains)
            fetched, heal = _fetch(c, choice, nodes, found, rank, folder, keeps, group)
            result = load(folder.tag_folder(c.tag).url, None)
            where = f"{fetched} file(s) fetched from peer nodes" if fetched else "every file from its own node"
            if c.world_size != world_size:
                where += f", resharded from world size {c.world_size} to {world_size}"
            return result, _say(rank, f"recovered from the memory tier: {c.tag} (step {c.step}), {where}; "
                                      f"skipped: {skipped}"), heal
        except PeerLostError:
            raise
        except ZeroshardError as exc:
            if durable is None:
                raise
            skipped = f"{c.tag} failed: {exc}; " + skipped
    if durable is None:
        raise StorageError(folder.path, f"no memory checkpoint to recover from ({skipped}) and no durable path given")
    result = load(durable, storage_options)
    return result, _say(rank, f"recovered from the durable tier: {durable} (step {durable_step}); "
                              f"memory tier skipped: {skipped}"), None


def _fetch(c: Candidate, choice: Choice, nodes: list[list[int]], found: list[list[Candidate]], rank: int,
           folder: MemoryFolder, keeps: dict[int, list[int]], group: Any) -> tuple[int, Callable[[], None] | None]:
    """Step 4 for this rank: the files the load reads, and the manifest, now; returns how many
    files the job fetched, and the rest (the replicas a node keeps) as a callable to run in the
    background once the load is done (None, on every rank alike, when there is nothing left)."""
    have_manifest = [any(x.id == c.id for x in node) for node in found]
    plan = fetch_plan(choice, nodes, have_manifest)
    # the replicas kept are of this world size's files: at another one the next save places them
    same = c.world_size == sum(len(ranks) for ranks in nodes)
    rest = [t for t in fetch_plan(choice, nodes, have_manifest, keeps) if t not in plan] if same else []
    target = folder.tag_folder(c.tag)
    error = None
    try:
        if any(dst == rank for _, _, _, dst in plan + rest):
            folder.claim()  # files land only in a folder of this job's
        if any(dst == rank for _, _, _, dst in plan):
            if target.exists(MANIFEST_NAME) and not have_manifest[[n[0] for n in nodes].index(rank)]:
                target.remove(MANIFEST_NAME)  # another save's manifest: un-commit before its files change
            target.makedirs()
    except Exception as exc:
        error = exc
    sizes = {name: (size, digest) for _, name, size, digest in c.files}

    def read(name: str) -> torch.Tensor:
        return map_file(os.path.join(target.path, name))

    def check(name: str, size: int, digest: str, file_rank: int) -> None:
        if name != MANIFEST_NAME and (size, digest) != sizes[name]:
            raise StorageError(target.url_of(name), "copy fetched from a peer fails its hash")  # never in place

    landing = Landing(target.path, refused=error)  # a folder not claimed or made: received, not kept
    files = [t for t in plan if t[0] != MANIFEST_NAME]
    manifests = [t for t in plan if t[0] == MANIFEST_NAME]  # last: it commits the node's folder
    failed = run_transfers(files, rank, read, check, group, landing)  # always: peers must not wait on us
    error = error or failed
    # the manifest lands only over every file it names (else it is received and dropped)
    failed = run_transfers(manifests, rank, read, check, group, Landing(target.path, refused=error))
    error = error or failed
    if error is None and any(dst == rank for _, _, _, dst in manifests):
        try:
            update_latest(folder.location, c.tag)
        except Exception as exc:
            error = exc
    agree(error, group, action=ACTION)

    def heal() -> None:
        agree(run_transfers(rest, rank, read, check, group, landing), group,
              action="restoring the memory tier's replicas")
    return sum(1 for t in plan + rest if t[0] != MANIFEST_NAME), heal if rest else None


def _durable_step(path: str, storage_options: dict | None) -> int | None:
    """The step of the durable root's newest checkpoint; None when it holds none."""
    try:
        return open_checkpoint(path, storage_options)[1].step or 0
    except ZeroshardError:
        return None


def _say(rank: int, line: str) -> str:
    line = "zeroshard: " + line
    if rank == 0:
        log.info(line)
    return line
