"""What the engine's collectives move, counted as they are issued.

Every collective the engine issues goes through the wrappers in collectives.py, which record
its kind and payload here. The payload is the full tensor a collective is about: the gathered
output of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce or a
broadcast. What one rank sends over a ring follows from it (the ZeRO paper's accounting):

    all-reduce      2 * payload * (N - 1) / N      (a reduce-scatter then an all-gather)
    reduce-scatter      payload * (N - 1) / N
    all-gather          payload * (N - 1) / N
    broadcast           payload                    (what the root sends; tree-shaped in practice)

so data parallelism moves 2Ψ per rank per step, ZeRO stages 1 and 2 the same 2Ψ (reduce-scatter
the gradients, all-gather the updated parameters) and stage 3 3Ψ (parameters gathered for the
forward and again for the backward). One ledger per process: engines read differences of it.

Node crossings: with ranks laid out node by node (`node_size` ranks per node, as torchrun
numbers them; the engine sets it from LOCAL_WORLD_SIZE, else zero_hpz_partition_size), a ring
over a group's ranks in rank order sends the same bytes on every hop, so the bytes that cross a
node boundary, averaged over the group's ranks, are `sent * crossing hops / group size` (a
broadcast: payload * (nodes spanned - 1) / group size). Each collective is recorded with its own
group's size, so hpZ's in-node gathers (size node_size) and cross-node ones count as they run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


@dataclass
class LedgerEntry:
    calls: int = 0
    payload_bytes: int = 0
    payload_elements: int = 0
    sent_elements: float = 0.0  # what one rank sends, by the ring formulas at the group's size
    sent_bytes: float = 0.0
    cross_node_elements: float = 0.0  # of which across a node boundary (averaged over the group)
    cross_node_bytes: float = 0.0


@dataclass
class CommLedger:
    entries: dict[str, LedgerEntry] = field(default_factory=dict)
    node_size: int = 0  # ranks per node (0: one node)

    def set_node_size(self, node_size: int) -> None:
        self.node_size = node_size

    def _shape(self, kind: str, group: Any) -> tuple[int, float]:
        """(group size, fraction of one rank's sent bytes that crosses a node, on average).
        Not cached: a cache would hold process groups (and their gloo threads) alive."""
        if group is None or not dist.is_initialized():
            return 1, 0.0
        ranks = sorted(dist.get_process_group_ranks(group))
        nodes = [r // self.node_size if self.node_size else 0 for r in ranks]
        n = len(ranks)
        if kind == "broadcast":
            return n, (len(set(nodes)) - 1) / n
        return n, sum(nodes[i] != nodes[(i + 1) % n] for i in range(n)) / n

    def record(self, kind: str, elements: int, element_size: int, group: Any = None) -> None:
        entry = self.entries.setdefault(kind, LedgerEntry())
        entry.calls += 1
        entry.payload_elements += elements
        entry.payload_bytes += elements * element_size
        size, crossing = self._shape(kind, group)
        sent = sent_per_rank(kind, elements, size)
        entry.sent_elements += sent
        entry.sent_bytes += sent * element_size
        across = sent * crossing if kind != "broadcast" else elements * crossing
        entry.cross_node_elements += across
        entry.cross_node_bytes += across * element_size

    def snapshot(self) -> dict[str, LedgerEntry]:
        return {kind: LedgerEntry(e.calls, e.payload_bytes, e.payload_elements, e.sent_elements, e.sent_bytes,
                                  e.cross_node_elements, e.cross_node_bytes) for kind, e in self.entries.items()}


LEDGER = CommLedger()


def sent_per_rank(kind: str, payload: float, world: int) -> float:
    """Bytes (or elements) one rank sends for a collective of `payload` over `world` ranks."""
    if world <= 1:
        return 0.0
    if kind == "broadcast":
        return float(payload)
    return RING_FACTOR[kind] * payload * (world - 1) / world


_FIELDS = ("calls", "payload_bytes", "payload_elements", "sent_bytes", "sent_elements",
           "cross_node_bytes", "cross_node_elements")


def report(since: dict[str, LedgerEntry], steps: int, world: int) -> dict[str, dict[str, float]]:
    """Per optimizer step, by kind: calls, payload bytes and elements, what one rank sends (bytes
    and elements) by the ring formulas above at each collective's group size, and of that what
    crosses a node boundary (cross_node_*); `total` sums the kinds. `world` is kept for callers;
    the group sizes come from the collectives themselves."""
    now = LEDGER.snapshot()
    per_step = max(steps, 1)
    out: dict[str, dict[str, float]] = {}
    total = dict.fromkeys(_FIELDS, 0.0)
    for kind, entry in sorted(now.items()):
        before = since.get(kind, LedgerEntry())
        row = {f: (getattr(entry, f) - getattr(before, f)) / per_step for f in _FIELDS}
        if not row["calls"]:
            continue
        out[kind] = row
        for key in total:
            total[key] += row[key]
    out["total"] = total
    return out
