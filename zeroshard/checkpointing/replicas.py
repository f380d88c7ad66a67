"""Peer replicas: which node keeps a copy of which rank file, and moving files between ranks.

A node is a host (ZEROSHARD_HOST_ID, else the host name, as zeroshard/peers.py names it); nodes
are numbered by their lowest rank. Rank r, the j-th rank of node i, has its file copied to the
j-th rank (modulo their count) of nodes i+1 .. i+R: R different nodes, never its own, so losing
any R nodes leaves a copy of every file. (Failure domains wider than a node, such as racks, are
not modelled yet: placing by node order puts neighbours in different racks only if the launcher
numbers them so.)

Files travel point to point (gloo isend/irecv) on the Checkpointer's own group, all of a rank's
at once, sizes first; a transfer that fails at its source still sends a size (-1), so the
receiver never hangs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from zeroshard.peers import peer_loss_translated


def node_map(hosts: Sequence[str]) -> list[list[int]]:
    """The ranks of each node, nodes in order of their lowest rank."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    return list(nodes.values())


def lead_of(hosts: Sequence[str], rank: int) -> int:
    """The lowest rank on `rank`'s node: the one that prunes, commits and fetches for it."""
    return hosts.index(hosts[rank])


def replica_targets(hosts: Sequence[str], replicas: int) -> dict[int, list[int]]:
    """file rank -> the ranks (on other nodes) that keep a copy of its file."""
    nodes = node_map(hosts)
    count = min(replicas, len(nodes) - 1)
    targets: dict[int, list[int]] = {}
    for i, ranks in enumerate(nodes):
        for j, rank in enumerate(ranks):
            targets[rank] = [nodes[(i + k) % len(nodes)][j % len(nodes[(i + k) % len(nodes)])]
                             for k in range(1, count + 1)]
    return targets


Read = Callable[[str], torch.Tensor]
Received = Callable[[str, torch.Tensor, int], None]


def run_transfers(plan: Sequence[tuple[str, int, int, int]], me: int, read: Read, received: Received,
                  group: Any) -> BaseException | None:
    """Carry out `plan` ((name, file rank, source rank, destination rank), in order) for this rank:
    send what it is the source of, receive (and hand to `received`) what it is the destination
    of. Returns this rank's first error (for the caller to agree on), never raises mid-plan."""
    with peer_loss_translated("copying checkpoint files between nodes"):
        return _run(plan, me, read, received, group)


def _run(plan: Sequence[tuple[str, int, int, int]], me: int, read: Read, received: Received,
         group: Any) -> BaseException | None:
    """Two rounds, each fully non-blocking (every send and receive of this rank posted at once,
    told apart by tag = position in the plan, then all waited for): the sizes, then the bytes.
    So a rank's outgoing and incoming copies travel at the same time."""
    import torch.distributed as dist

    error: BaseException | None = None
    mine = [(i, entry) for i, entry in enumerate(plan) if entry[2] != entry[3] and me in (entry[2], entry[3])]
    outgoing: dict[int, torch.Tensor] = {}
    sizes: dict[int, torch.Tensor] = {}
    works = []
    for i, (name, _, src, dst) in mine:
        if me == src:
            try:
                outgoing[i] = read(name)
            except Exception as exc:
                error = error or exc
            size = torch.tensor([outgoing[i].numel() if i in outgoing else -1], dtype=torch.int64)
            works.append(dist.isend(size, dst, group=group, tag=i))
        else:
            sizes[i] = torch.empty(1, dtype=torch.int64)
            works.append(dist.irecv(sizes[i], src, group=group, tag=i))
    for work in works:
        work.wait()
    works, incoming = [], {}
    for i, (name, _, src, dst) in mine:
        if me == src and i in outgoing and outgoing[i].numel():
            works.append(dist.isend(outgoing[i], dst, group=group, tag=i))
        elif me == dst and int(sizes[i].item()) > 0:
            incoming[i] = torch.empty(int(sizes[i].item()), dtype=torch.uint8)
            works.append(dist.irecv(incoming[i], src, group=group, tag=i))
    for work in works:
        work.wait()
    for i, (name, file_rank, src, dst) in mine:
        if me != dst:
            continue
        if int(sizes[i].item()) < 0:
            error = error or OSError(f"rank {src} could not read {name} to send it")
            continue
        try:
            received(name, incoming.get(i, torch.empty(0, dtype=torch.uint8)), file_rank)
        except Exception as exc:
            error = error or exc
    return error
