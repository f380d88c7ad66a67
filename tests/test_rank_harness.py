"""The rank harness (tests/distributed.py) itself: what it does about its own races and leftovers."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

import distributed

TIER = "default"  # docs/TESTING.md


def _sum_of_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_a_rendezvous_port_taken_by_a_neighbour_is_retried_on_a_fresh_one(monkeypatch):
    """Between free_port() and rank 0's bind, another process can take the port (seen once in
    292 slow-tier tests on 3 workers): EADDRINUSE is the harness's race, so the call is made again."""
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    real_free_port = distributed.free_port
    monkeypatch.setattr(distributed, "free_port", lambda: next(ports, None) or real_free_port())
    try:
        assert distributed.run_ranks(_sum_of_ranks, 2, timeout=60) == [1.0, 1.0]
    finally:
        squatter.close()
    assert next(ports, "used") == "used"  # the first call did get the taken port
