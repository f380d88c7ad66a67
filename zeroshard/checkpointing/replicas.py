"""Peer replicas: which node keeps a copy of which rank file, and moving files between ranks.

A node is a host (ZEROSHARD_HOST_ID, else the host name, as zeroshard/peers.py names it); nodes
are numbered by their lowest rank. Rank r, the j-th rank of node i, has its file copied to the
j-th rank (modulo their count) of nodes i+1 .. i+R: R different nodes, never its own, so losing
any R nodes leaves a copy of every file. A failure domain can span several nodes (a rack:
ZEROSHARD_DOMAIN or TierPolicy.domain, the same on a node's ranks): then the nodes are put in a
ring that takes one node of each domain in turn, and each copy goes to the next node in the ring
whose domain holds no copy yet (its own included), else to the next node: losing a whole domain
leaves a copy of every file whenever there are two domains or more.

Files travel point to point (gloo send/recv) on the Checkpointer's own group, one transfer at a
time in one order every rank follows, sent straight from the file mapped in memory; a transfer
that fails at its source still sends a size (-1), so the receiver never hangs.

[Note: landing in chunks] A file arrives in CHUNK_BYTES messages, each received into one of two
reused buffers, hashed, and written to a temp file by a background thread while the next chunk
arrives (Location.atomic_writer with write_behind); the temp file is renamed into place once the
whole file's hash holds. Receiving a whole file straight into a sparse tmpfs file mapped in
memory (what this did before) faults in every page from the receiving thread: 100 MB took
0.16-0.18 s here, against 0.11-0.13 s in chunks, which is what gloo takes to receive the bytes
into memory already touched. A full tmpfs is also an error from write(), not a SIGBUS.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable, Sequence

import torch

from zeroshard.peers import peer_loss_translated
from zeroshard.storage.hashing import new_hasher
from zeroshard.storage.location import Location


def node_map(hosts: Sequence[str]) -> list[list[int]]:
    """The ranks of each node, nodes in order of their lowest rank."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    return list(nodes.values())


def lead_of(hosts: Sequence[str], rank: int) -> int:
    """The lowest rank on `rank`'s node: the one that prunes, commits and fetches for it."""
    return hosts.index(hosts[rank])


def replica_targets(hosts: Sequence[str], replicas: int,
                    domains: Sequence[str] | None = None) -> dict[int, list[int]]:
    """file rank -> the ranks (on other nodes) that keep a copy of its file. `domains[rank]`: the
    failure domain of rank's node (a rack: ZEROSHARD_DOMAIN); None, each node is its own."""
    nodes = node_map(hosts)
    count = min(replicas, len(nodes) - 1)
    domain = [domains[ranks[0]] if domains is not None else str(i) for i, ranks in enumerate(nodes)]
    ring = _interleaved(domain)
    targets: dict[int, list[int]] = {}
    for i, ranks in enumerate(nodes):
        at = ring.index(i)
        after = [ring[(at + k) % len(ring)] for k in range(1, len(ring))]
        chosen: list[int] = []
        used = {domain[i]}
        for _ in range(count):  # a domain not holding a copy yet when one is left, else the next node
            pick = next((m for m in after if m not in chosen and domain[m] not in used),
                        next(m for m in after if m not in chosen))
            chosen.append(pick)
            used.add(domain[pick])
        for j, rank in enumerate(ranks):
            targets[rank] = [nodes[m][j % len(nodes[m])] for m in chosen]
    return targets


def _interleaved(domain: Sequence[str]) -> list[int]:
    """Nodes in a ring taking one node of each domain in turn (domains in order of their first
    node), so a node's neighbours are in other domains and copies spread evenly over them.
    With every node its own domain: node order, i -> i+1 .. i+R."""
    groups: dict[str, list[int]] = {}
    for n, d in enumerate(domain):
        groups.setdefault(d, []).append(n)
    ring: list[int] = []
    for turn in range(max((len(g) for g in groups.values()), default=0)):
        ring += [g[turn] for g in groups.values() if turn < len(g)]
    return ring


Read = Callable[[str], torch.Tensor]
Check = Callable[[str, int, str, int], None]  # (name, size, hash, file rank): raises to refuse the copy
CHUNK_BYTES = 16 * 2**20  # one gloo message; two buffers of it per receiving rank


class Landing:
    """Files received into `folder`: each lands in a temp file (written behind the receive) and is
    renamed into place once `check` accepts its size and hash; a refused or failed one is removed.
    `refused`: an error that keeps every file out (the folder may not be written): each is still
    received, so the senders finish, and this error is what the transfers return."""

    def __init__(self, folder: str, refused: BaseException | None = None) -> None:
        self.folder, self.refused = Location(folder), refused

    def writer(self, name: str) -> Any:
        if self.refused is not None:
            raise self.refused
        return self.folder.atomic_writer(name, durable=False, write_behind=True)


def run_transfers(plan: Sequence[tuple[str, int, int, int]], me: int, read: Read, check: Check,
                  group: Any, landing: Landing) -> BaseException | None:
    """Carry out `plan` ((name, file rank, source rank, destination rank), in order) for this rank:
    send what it is the source of, receive into `landing` what it is the destination of (kept
    when `check` accepts it). Returns this rank's first error (for the caller to agree on), never
    raises mid-plan."""
    with peer_loss_translated("copying checkpoint files between nodes"):
        return _run(plan, me, read, check, group, landing)


def _run(plan: Sequence[tuple[str, int, int, int]], me: int, read: Read, check: Check,
         group: Any, landing: Landing) -> BaseException | None:
    """One transfer at a time, in plan order on every rank (a total order of blocking sends and
    receives: no two ranks can wait on each other crosswise). Measured here, gloo moves two
    files one after the other several times faster than both at once (tools/bench_recovery.py)."""
    import torch.distributed as dist

    error: BaseException | None = None
    buffers: list[torch.Tensor] = []
    for name, file_rank, src, dst in plan:
        if src == dst or me not in (src, dst):
            continue
        if me == src:
            data = None
            try:
                data = read(name)
            except Exception as exc:
                error = error or exc
            dist.send(torch.tensor([-1 if data is None else data.numel()], dtype=torch.int64), dst, group=group)
            for at in range(0, 0 if data is None else data.numel(), CHUNK_BYTES):
                dist.send(data[at:at + CHUNK_BYTES], dst, group=group)
            continue
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=group)
        if int(size.item()) < 0:
            error = error or OSError(f"rank {src} could not read {name} to send it")
            continue
        buffers = buffers or [_buffer() for _ in range(2)]
        failed = _receive(name, file_rank, int(size.item()), src, group, landing, check, buffers)
        error = error or failed  # the first error is the one reported
    return error


def _receive(name: str, file_rank: int, size: int, src: int, group: Any, landing: Landing, check: Check,
             buffers: list[torch.Tensor]) -> BaseException | None:
    """One file off the wire, chunk by chunk, into `landing`. Whatever fails, every byte is
    still received (each of the sender's sends must be matched). Returns what kept it out."""
    import torch.distributed as dist

    done = 0
    try:
        with landing.writer(name) as writer:
            hasher = new_hasher()
            for k, at in enumerate(range(0, size, CHUNK_BYTES)):
                chunk = buffers[k % 2][:min(CHUNK_BYTES, size - at)]  # its write of 2 chunks ago has returned
                dist.recv(chunk, src, group=group)
                done = at + chunk.numel()
                view = memoryview(chunk.numpy())
                hasher.update(view)
                writer.write(view)
            check(name, size, hasher.hexdigest(), file_rank)  # refused: the temp file is removed
    except Exception as exc:
        for k, at in enumerate(range(done, size, CHUNK_BYTES)):  # the rest off the wire
            dist.recv(buffers[k % 2][:min(CHUNK_BYTES, size - at)], src, group=group)
        return exc
    return None


def _buffer() -> torch.Tensor:
    """A reusable receive buffer in anonymous memory, on huge pages where the kernel allows."""
    area = mmap.mmap(-1, CHUNK_BYTES)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return torch.frombuffer(area, dtype=torch.uint8)


def map_file(path: str) -> torch.Tensor:
    """A file's bytes as a tensor mapped onto it (tmpfs: no copy, no fresh memory to touch)."""
    size = os.path.getsize(path)
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
