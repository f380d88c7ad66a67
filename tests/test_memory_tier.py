"""The memory tier with peer replicas (issue 26): policy, placement and the recovery choice without
launches first, then 2 "nodes" (ZEROSHARD_HOST_ID per rank) on gloo ranks, with a per-test folder
standing in for each node's tmpfs."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import zeroshard
from zeroshard.checkpointing import TierPolicy
from zeroshard.checkpointing.memory_tier import MemoryFolder, check_fits
from zeroshard.checkpointing.recovery import Candidate, Choice, choose, fetch_plan
from zeroshard.checkpointing.replicas import lead_of, node_map, replica_targets
from zeroshard.cli import main
from zeroshard.errors import CheckpointSaveError, ConfigError
from zeroshard.format import build_manifest, commit_checkpoint, rank_contents, write_rank_file
from zeroshard.format.writer import TensorSpec
from zeroshard.storage import Location

from distributed import run_ranks


# ---- without launches ---------------------------------------------------------------------------
def test_policy_defaults_validation_and_what_is_due(monkeypatch):
    policy = TierPolicy()
    assert (policy.memory_every, policy.durable_every, policy.replicas, policy.memory_keep_last) == (10, 100, 1, 2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-9")
    assert policy.root() == "/dev/shm/zeroshard-job-9"
    assert [TierPolicy(memory_every=2, durable_every=4).due(s) for s in (1, 2, 4)] == [
        (False, False), (True, False), (True, True)]
    assert TierPolicy(memory_every=3, durable_every=4, drain=False).due(4) == (False, True)
    assert TierPolicy(memory_every=3, durable_every=4).due(4) == (True, True)  # drained: memory first
    for bad in ({"memory_every": 0}, {"replicas": -1}, {"memory_keep_last": 0}, {"memory_dir": "s3://b/x"},
                {"memory_cap_bytes": 0}, {"durable_every": True}):
        with pytest.raises(ConfigError, match="TierPolicy"):
            TierPolicy(**bad)


def test_replicas_go_to_other_nodes_and_survive_losing_r_nodes():
    hosts = ["a", "a", "b", "b"]
    assert node_map(hosts) == [[0, 1], [2, 3]] and lead_of(hosts, 3) == 2
    assert replica_targets(hosts, 1) == {0: [2], 1: [3], 2: [0], 3: [1]}
    assert replica_targets(["a", "a"], 1) == {0: [], 1: []}  # one node: nowhere else to put a copy
    hosts = ["a", "b", "c", "c"]
    targets = replica_targets(hosts, 2)
    for rank, dsts in targets.items():
        assert len({hosts[d] for d in dsts}) == 2 and hosts[rank] not in {hosts[d] for d in dsts}


def _cand(step: int, world: int = 2, buffers: bool = False) -> Candidate:
    return Candidate(f"id{step}", f"step-{step:08d}", step, world,
                     tuple((r, f"rank-{r:05d}-of-{world:05d}.safetensors", 10, "h") for r in range(world)), buffers)


def test_choose_takes_the_newest_checkpoint_every_rank_has_a_verified_copy_of():
    c2, c4, c6 = _cand(2), _cand(4), _cand(6)
    found = [[c2, c4, c6], [c2, c4]]  # node 1 never committed step 6 ...
    held = [{"id2": [0, 1], "id4": [0], "id6": [0]}, {"id2": [0, 1], "id4": [1]}]  # ... and lost rank 1's copy
    choice = choose(found, held, 2, durable_step=None)
    assert choice.candidate == c4 and choice.holders == {0: [0], 1: [1]}
    assert choice.skipped == ["step-00000006 has no verified copy of the file(s) of rank(s) 1"]
    choice = choose(found, held, 2, durable_step=5)  # the durable root is newer than step 4
    assert choice.candidate is None and "older than the durable step 5" in choice.skipped[1]
    choice = choose([[_cand(8, world=4)], []], [{}, {}], 2, None)
    assert choice.candidate is None and "world size 4, not 2" in choice.skipped[0]


def test_a_node_that_lost_its_folder_fetches_its_files_and_then_the_manifest():
    c = _cand(4, world=4, buffers=True)
    nodes = [[0, 1], [2, 3]]
    choice = Choice(c, {0: [0], 1: [0], 2: [0], 3: [0]})  # node 1's folder was wiped: node 0 holds all
    plan = fetch_plan(choice, nodes, [True, False])
    assert plan[-1][0] == "zeroshard.json" and [(n[5:10], src, dst) for n, _, src, dst in plan] == [
        ("00000", 0, 2), ("00002", 0, 2), ("00003", 0, 2), ("hard.", 0, 2)]  # rank 0's for the buffers
    assert fetch_plan(Choice(c, {r: [0, 1] for r in range(4)}), nodes, [True, True]) == []


def _fill(folder: Path, tag: str, nbytes: int, manifest: bool = True) -> None:
    """A one-rank checkpoint of `nbytes` of U8 at step int(tag[-8:]), committed or torn."""
    spec = TensorSpec("blob", "extra", "U8", (nbytes,), "local", owner=0)
    location = Location(str(folder / tag))
    result = write_rank_file(location, uuid.uuid4().hex, 0, 1, rank_contents([spec], 1, 0),
                             lambda s, a, b, write: write(memoryview(bytes(b - a))))
    if manifest:
        commit_checkpoint(location, build_manifest([spec], 1, [result], uuid.uuid4().hex, step=int(tag[-8:]), tag=tag))


def test_a_save_over_the_cap_or_the_free_space_is_refused_before_anything_is_written(tmp_path):
    folder = MemoryFolder(str(tmp_path), "nodeA")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointSaveError) as err:
        check_fits(folder, "step-00000002", 2, 10 << 20, cap=1 << 20, min_free_fraction=0.1)
    assert "memory_cap_bytes" in str(err.value) and len(str(err.value).splitlines()) == 1
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(CheckpointSaveError, match="would not fit in the .* MiB the tmpfs can spare"):
        check_fits(folder, "step-00000002", 2, free + (1 << 30), cap=None, min_free_fraction=0.0)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
    check_fits(folder, "step-00000002", 2, 1 << 20, cap=2 << 20, min_free_fraction=0.0)  # fits


def test_keep_last_counts_the_save_being_written_and_torn_folders_go_first(tmp_path):
    node = tmp_path / "nodeA"
    for step in (2, 4, 6):
        _fill(node, f"step-{step:08d}", 1000)
    _fill(node, "step-00000008", 1000, manifest=False)  # torn by a kill
    folder = MemoryFolder(str(tmp_path), "nodeA")
    doomed, kept = folder.doomed("step-00000010", keep_last=2)
    assert doomed == ["step-00000002", "step-00000004", "step-00000008"]
    assert [c.tag for c in kept] == ["step-00000006"]
    size = kept[0].nbytes
    assert size > 1000
    # the cap counts what is kept (one checkpoint), not what the save removes first
    check_fits(folder, "step-00000010", 2, 1500, cap=size + 1500, min_free_fraction=0.0)
    with pytest.raises(CheckpointSaveError):
        check_fits(folder, "step-00000010", 2, 1501, cap=size + 1500, min_free_fraction=0.0)
    assert folder.doomed("step-00000006", keep_last=1)[0] == [f"step-{s:08d}" for s in (2, 4, 6, 8)]
