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
"""

from __future__ import annotations

from dataclasses import dataclass, field

RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0}


@dataclass
class LedgerEntry:
    calls: int = 0
    payload_bytes: int = 0
    payload_elements: int = 0


@dataclass
class CommLedger:
    entries: dict[str, LedgerEntry] = field(default_factory=dict)

    def record(self, kind: str, elements: int, element_size: int) -> None:
        entry = self.entries.setdefault(kind, LedgerEntry())
        entry.calls += 1
        entry.payload_elements += elements
        entry.payload_bytes += elements * element_size

    def snapshot(self) -> dict[str, LedgerEntry]:
        return {kind: LedgerEntry(e.calls, e.payload_bytes, e.payload_elements) for kind, e in self.entries.items()}


LEDGER = CommLedger()


def sent_per_rank(kind: str, payload: float, world: int) -> float:
    """Bytes (or elements) one rank sends for a collective of `payload` over `world` ranks."""
    if world <= 1:
        return 0.0
    if kind == "broadcast":
        return float(payload)
    return RING_FACTOR[kind] * payload * (world - 1) / world


def report(since: dict[str, LedgerEntry], steps: int, world: int) -> dict[str, dict[str, float]]:
    """Per optimizer step, by kind: calls, payload bytes and elements, and what one rank sends
    (bytes and elements) by the ring formulas above; `total` sums the kinds."""
    now = LEDGER.snapshot()
    per_step = max(steps, 1)
    out: dict[str, dict[str, float]] = {}
    total = dict.fromkeys(["calls", "payload_bytes", "payload_elements", "sent_bytes", "sent_elements"], 0.0)
    for kind, entry in sorted(now.items()):
        before = since.get(kind, LedgerEntry())
        row = {"calls": (entry.calls - before.calls) / per_step,
               "payload_bytes": (entry.payload_bytes - before.payload_bytes) / per_step,
               "payload_elements": (entry.payload_elements - before.payload_elements) / per_step}
        if not row["calls"]:
            continue
        row["sent_bytes"] = sent_per_rank(kind, row["payload_bytes"], world)
        row["sent_elements"] = sent_per_rank(kind, row["payload_elements"], world)
        out[kind] = row
        for key in total:
            total[key] += row[key]
    out["total"] = total
    return out
