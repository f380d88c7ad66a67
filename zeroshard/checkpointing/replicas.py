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
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Sequence

import torch

from zeroshard.peers import peer_loss_translated
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
Received = Callable[[str, torch.Tensor, int], None]
Allocate = Callable[[str, int], torch.Tensor]


class Landing:
    """Files received straight into their folder: each lands in a temp file mapped in memory (so
    its bytes are touched once, by the receive), then is renamed into place once checked."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._temps: dict[str, str] = {}

    def allocate(self, name: str, size: int) -> torch.Tensor:
        folder = Location(self.folder)
        temp_name = folder.temp_name(name)
        folder.create_exclusive(temp_name, b"", durable=False)
        temp = folder.full_path(temp_name)
        os.truncate(temp, size)  # sparse: the receive touches each page once
        self._temps[name] = temp
        return map_file(temp)

    def keep(self, name: str) -> None:
        os.replace(self._temps.pop(name), os.path.join(self.folder, name))

    def drop(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._temps.pop(name))


def run_transfers(plan: Sequence[tuple[str, int, int, int]], me: int, read: Read, received: Received,
                  group: Any, allocate: Allocate | None = None) -> BaseException | None:
    """Carry out `plan` ((name, file rank, source rank, destination rank), in order) for this rank:
    send what it is the source of, receive (and hand to `received`) what it is the destination
    of. Returns this rank's first error (for the caller to agree on), never raises mid-plan."""
    with peer_loss_translated("copying checkpoint files between nodes"):
        return _run(plan, me, read, received, group, allocate)


def _run(plan: Sequence[tuple[str, int, int, int]], me: int, read: Read, received: Received,
         group: Any, allocate: Allocate | None) -> BaseException | None:
    """One transfer at a time, in plan order on every rank (a total order of blocking sends and
    receives: no two ranks can wait on each other crosswise). Measured here, gloo moves two
    files one after the other several times faster than both at once (tools/bench_recovery.py)."""
    import torch.distributed as dist

    error: BaseException | None = None
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
            if data is not None and data.numel():
                dist.send(data, dst, group=group)
            continue
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=group)
        if int(size.item()) < 0:
            error = error or OSError(f"rank {src} could not read {name} to send it")
            continue
        landed = True
        try:
            data = (allocate or _empty)(name, int(size.item()))
        except Exception as exc:  # the bytes must still be taken off the wire
            error, data, landed = error or exc, _empty(name, int(size.item())), False
        if data.numel():
            dist.recv(data, src, group=group)
        if not landed:
            continue
        try:
            received(name, data, file_rank)
        except Exception as exc:
            error = error or exc
    return error


def _empty(name: str, size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8)


def map_file(path: str) -> torch.Tensor:
    """A file's bytes as a tensor mapped onto it (tmpfs: no copy, no fresh memory to touch)."""
    size = os.path.getsize(path)
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
