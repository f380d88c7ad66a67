"""The memory tier with peer replicas (issue 26): policy, placement and the recovery choice without
launches first, then 2 "nodes" (ZEROSHARD_HOST_ID per rank) on gloo ranks, with a per-test folder
standing in for each node's tmpfs."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
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

from distributed import free_port, run_ranks

TIER = "mixed"  # docs/TESTING.md


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


def test_copies_go_to_another_failure_domain_when_one_exists(monkeypatch):
    hosts = ["a", "b", "c", "d"]  # one rank per node; racks: {a, b} and {c, d}
    racks = ["r1", "r1", "r2", "r2"]
    assert replica_targets(hosts, 1) == {0: [1], 1: [2], 2: [3], 3: [0]}  # no domains: node order
    targets = replica_targets(hosts, 1, racks)
    assert all(racks[d] != racks[r] for r, dsts in targets.items() for d in dsts), targets
    assert sorted(d for dsts in targets.values() for d in dsts) == [0, 1, 2, 3]  # one copy kept per node
    hosts = [f"n{i}" for i in range(6)]  # 3 racks of 2 nodes, 2 copies: the 3 racks hold each file
    racks = ["r1", "r1", "r2", "r2", "r3", "r3"]
    for rank, dsts in replica_targets(hosts, 2, racks).items():
        assert len({racks[d] for d in dsts} | {racks[rank]}) == 3, (rank, dsts)
    hosts = ["a", "b", "c"]  # racks {a, b} and {c}: c, alone in r2, keeps the copies of a and b
    targets = replica_targets(hosts, 1, ["r1", "r1", "r2"])
    assert targets[0] == [2] and targets[1] == [2] and targets[2] in ([0], [1])
    assert replica_targets(["a", "b"], 1, ["r1", "r1"]) == {0: [1], 1: [0]}  # one domain: other nodes still
    hosts, racks = ["a", "a", "b", "b", "c", "c", "d", "d"], ["r1"] * 4 + ["r2"] * 4  # ranks on nodes
    targets = replica_targets(hosts, 1, racks)
    assert all(racks[d] != racks[r] and hosts[d] != hosts[r] for r, dsts in targets.items() for d in dsts)
    monkeypatch.setenv("ZEROSHARD_DOMAIN", "rack-7")
    assert TierPolicy().domain_name("n1") == "rack-7" and TierPolicy(domain="r").domain_name("n1") == "r"
    monkeypatch.delenv("ZEROSHARD_DOMAIN")
    assert TierPolicy().domain_name("n1") == "n1"


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
    c8 = _cand(8, world=4)  # saved by 4 ranks, recovered by 2: chosen when its 4 files survive
    choice = choose([[c8], []], [{"id8": [0, 1, 2, 3]}, {}], 2, None)
    assert choice.candidate == c8 and choice.holders == {r: [0] for r in range(4)}
    choice = choose([[c8], []], [{"id8": [0, 1, 3]}, {}], 2, None)
    assert choice.candidate is None and "rank(s) 2" in choice.skipped[0]


def test_a_node_that_lost_its_folder_fetches_its_files_and_then_the_manifest():
    c = _cand(4, world=4, buffers=True)
    nodes = [[0, 1], [2, 3]]
    choice = Choice(c, {0: [0], 1: [0], 2: [0], 3: [0]})  # node 1's folder was wiped: node 0 holds all
    plan = fetch_plan(choice, nodes, [True, False])
    assert plan[-1][0] == "zeroshard.json" and [(n[5:10], src, dst) for n, _, src, dst in plan] == [
        ("00000", 0, 2), ("00002", 0, 2), ("00003", 0, 2), ("hard.", 0, 2)]  # rank 0's for the buffers
    keeps = replica_targets([0, 0, 1, 1], 1)  # ... and node 1 keeps copies of ranks 0 and 1: fetched too
    assert [n[5:10] for n, _, _, _ in fetch_plan(choice, nodes, [True, False], keeps)] == [
        "00000", "00001", "00002", "00003", "hard."]
    assert fetch_plan(Choice(c, {r: [0, 1] for r in range(4)}), nodes, [True, True], keeps) == []


def test_at_a_new_world_size_each_node_gathers_every_old_file_and_keeps_no_stale_replicas():
    c = _cand(6, world=6)  # 3 nodes x 2 ranks saved it; node 2 was lost, 2 nodes x 1 rank go on
    holders = {0: [0], 1: [0], 2: [1], 3: [1], 4: [0], 5: [1]}  # each survivor: its own + the lost node's
    plan = fetch_plan(Choice(c, holders), [[0], [1]], [True, True])
    assert sorted((n[5:10], src, dst) for n, _, src, dst in plan) == [
        ("00000", 0, 1), ("00001", 0, 1), ("00002", 1, 0), ("00003", 1, 0), ("00004", 0, 1), ("00005", 1, 0)]
    keeps = replica_targets(["a", "b"], 1)  # of the new world's files: nothing to restore from old ones
    assert fetch_plan(Choice(c, holders), [[0], [1]], [True, True], keeps) == plan


JOB = "test-job"  # the job name every simulated job here runs under (TierPolicy.job)


def _fill(folder: Path, tag: str, nbytes: int, manifest: bool = True, job: str | None = JOB) -> None:
    """A one-rank memory checkpoint of `nbytes` of U8 at step int(tag[-8:]) saved by `job`,
    committed or torn."""
    spec = TensorSpec("blob", "extra", "U8", (nbytes,), "local", owner=0)
    location = Location(str(folder / tag))
    result = write_rank_file(location, uuid.uuid4().hex, 0, 1, rank_contents([spec], 1, 0),
                             lambda s, a, b, write: write(memoryview(bytes(b - a))))
    if manifest:
        extra = {"memory_tier": {"job": job}} if job else {}
        commit_checkpoint(location, build_manifest([spec], 1, [result], uuid.uuid4().hex, step=int(tag[-8:]), tag=tag,
                                                   extra=extra))


def test_a_save_over_the_cap_or_the_free_space_is_refused_before_anything_is_written(tmp_path):
    folder = MemoryFolder(str(tmp_path), "nodeA", JOB)
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
    folder = MemoryFolder(str(tmp_path), "nodeA", JOB)
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


# ---- two nodes of gloo ranks (ZEROSHARD_HOST_ID per rank) --------------------------------------
def _engine(seed: int = 0) -> Any:
    torch.manual_seed(seed)  # a BatchNorm: buffers live in rank 0's file, which every rank reads
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                config={"zero_optimization": {"stage": 2}})


def _step(engine: Any, step: int, rank: int) -> str:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(step * 100 + rank))
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss.item().hex()


def _as_node(rank: int, per_node: int) -> None:
    os.environ["ZEROSHARD_HOST_ID"] = f"node{'AB'[rank // per_node]}"


def train(rank: int, world: int, steps: int, per_node: int, mem: str | None = None, durable: str = "",
          policy: dict | None = None) -> dict[int, str]:
    """`steps` steps from scratch; with `mem`, Checkpointer.checkpoint() after each (policy)."""
    _as_node(rank, per_node)
    engine = _engine()
    ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=JOB, memory_dir=mem, **(policy or {}))) if mem else None
    losses = {}
    for step in range(steps):
        losses[step] = _step(engine, step, rank)
        if ckpt is not None:
            ckpt.checkpoint(durable, client_state={"next": step + 1})
    if ckpt is not None:
        ckpt.wait()
    return losses


def resume(rank: int, world: int, steps: int, per_node: int, mem: str, durable: str) -> tuple[int, dict, str]:
    """A restarted job: load from the best tier, train on to `steps` (saving nothing)."""
    _as_node(rank, per_node)
    engine = _engine(seed=5)
    ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=JOB, memory_dir=mem))
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("zeroshard.checkpointing.recovery")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        start = ckpt.load(durable)["next"]
    finally:
        logger.removeHandler(handler)
    assert logged == ([ckpt.last_recovery] if rank == 0 else []), logged  # one line, from rank 0
    losses = {step: _step(engine, step, rank) for step in range(start, steps)}  # replicas restored meanwhile
    ckpt.wait()
    return start, losses, ckpt.last_recovery


def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


ROOT = Path(__file__).resolve().parents[1]
HOST_ENV = {"ZEROSHARD_HOST_ID": "unset"}  # restored after each call


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_recover_from_own_memory_from_a_peer_copy_else_from_durable(tmp_path):
    mem, durable = tmp_path / "shm", tmp_path / "durable"
    reference = run_ranks(train, 4, timeout=300, env=HOST_ENV, steps=8, per_node=2)
    policy = {"memory_every": 2, "durable_every": 4}
    saved = run_ranks(train, 4, timeout=300, env=HOST_ENV, steps=6, per_node=2, mem=str(mem), durable=str(durable),
                      policy=policy)
    assert saved == [{s: v for s, v in losses.items() if s < 6} for losses in reference]  # saving changes nothing
    a, b = mem / "nodeA", mem / "nodeB"
    for node in (a, b):  # keep-last 2; every rank's file on both nodes (own + one replica)
        assert sorted(p.name for p in node.iterdir()) == ["job.json", "latest", "step-00000004", "step-00000006"]
        assert len(list((node / "step-00000006").glob("rank-*.safetensors"))) == 4
    assert _hashes(a) == _hashes(b)  # the same bytes, manifest included
    # the toolkit reads a node's folder unchanged; the drained durable copy holds the same files
    _cli("verify", str(a))
    _cli("inspect", str(a))
    _cli("reshard", "-q", str(a / "step-00000004"), "--to", "1", "-o", str(tmp_path / "one"))
    _cli("consolidate", "-q", str(b), str(tmp_path / "full.safetensors"))
    _cli("verify", str(durable))
    assert (durable / "latest").read_text().strip() == "step-00000004"
    drained, memory = _hashes(durable / "step-00000004"), _hashes(a / "step-00000004")
    manifest = json.loads((a / "step-00000004" / "zeroshard.json").read_text())
    assert manifest["extra"].pop("memory_tier") == {"job": JOB}  # the memory copy's own: which job saved it
    assert manifest == json.loads((durable / "step-00000004" / "zeroshard.json").read_text())
    assert drained.pop("zeroshard.json") != memory.pop("zeroshard.json") and drained == memory  # rank files
    before = _hashes(durable)
    # a save torn by a kill (rank files, no manifest) on both nodes is never chosen
    for node in (a, b):
        shutil.copytree(node / "step-00000006", node / "step-00000008")
        (node / "step-00000008" / "zeroshard.json").unlink()
    results = run_ranks(resume, 4, timeout=300, env=HOST_ENV, steps=8, per_node=2, mem=str(mem), durable=str(durable))
    for rank, (start, losses, line) in enumerate(results):
        assert start == 6 and losses == {s: v for s, v in reference[rank].items() if s >= 6}
        assert "memory tier: step-00000006 (step 6), every file from its own node" in line, line
        assert "step-00000008 torn (no manifest)" in line and len(line.splitlines()) == 1, line
    # node B lost its memory folder: its ranks' files (and rank 0's, for the buffers) come from node A
    shutil.rmtree(b)
    results = run_ranks(resume, 4, timeout=300, env=HOST_ENV, steps=8, per_node=2, mem=str(mem), durable=str(durable))
    for rank, (start, losses, line) in enumerate(results):
        assert start == 6 and losses == {s: v for s, v in reference[rank].items() if s >= 6}
        assert "memory tier: step-00000006 (step 6), 4 file(s) fetched from peer nodes" in line, line
    _cli("verify", str(b / "step-00000006"))  # node B's folder is whole again (replicas in the background)
    # both copies of node B's rank files lost: the durable tier, with the reason
    shutil.rmtree(b)
    for step in ("step-00000004", "step-00000006"):
        for rank in (2, 3):
            (a / step / f"rank-0000{rank}-of-00004.safetensors").unlink()
    results = run_ranks(resume, 4, timeout=300, env=HOST_ENV, steps=8, per_node=2, mem=str(mem), durable=str(durable))
    for rank, (start, losses, line) in enumerate(results):
        assert start == 4 and losses == {s: v for s, v in reference[rank].items() if s >= 4}
        assert f"durable tier: {durable} (step 4); memory tier skipped: step-00000006 has no verified copy of " \
               f"the file(s) of rank(s) 2, 3" in line, line
    assert _hashes(durable) == before  # nothing the memory tier did touched the durable root


@pytest.mark.timeout(600)
def test_a_lost_node_and_the_job_goes_on_with_fewer_ranks_from_the_surviving_copies(tmp_path):
    mem, durable = tmp_path / "shm", tmp_path / "durable"
    policy = {"memory_every": 2, "durable_every": 4}
    run_ranks(train, 4, timeout=300, env=HOST_ENV, steps=4, per_node=2, mem=str(mem), durable=str(durable),
              policy=policy)
    before = _hashes(durable)
    shutil.rmtree(mem / "nodeB")  # node B is gone; its 2 ranks' files survive as node A's replicas
    memory = run_ranks(resume, 2, timeout=300, env=HOST_ENV, steps=7, per_node=2, mem=str(mem),
                       durable=str(durable))
    # the same step resumed at 2 ranks from the durable root (an empty memory tier: nothing else)
    plain = run_ranks(resume, 2, timeout=300, env=HOST_ENV, steps=7, per_node=2, mem=str(tmp_path / "none"),
                      durable=str(durable))
    for (start, losses, line), (start2, losses2, line2) in zip(memory, plain):
        assert "memory tier: step-00000004 (step 4), every file from its own node, resharded from world size " \
               "4 to 2" in line, line
        assert f"durable tier: {durable} (step 4)" in line2, line2
        assert start == start2 == 4 and sorted(losses) == [4, 5, 6]
        assert losses == losses2  # bit for bit (float.hex)
    # 2 ranks on 2 nodes again, node B's folder empty: it fetches every old file from node A
    shutil.rmtree(mem / "nodeB", ignore_errors=True)
    fetched = run_ranks(resume, 2, timeout=300, env=HOST_ENV, steps=7, per_node=1, mem=str(mem),
                        durable=str(durable))
    for (start, losses, line), (_, losses2, _) in zip(fetched, plain):
        assert "step-00000004 (step 4), 4 file(s) fetched from peer nodes, resharded from world size 4 to 2" \
               in line, line
        assert start == 4 and losses == losses2
    assert _hashes(mem / "nodeB" / "step-00000004") == _hashes(mem / "nodeA" / "step-00000004")
    assert _hashes(durable) == before


def test_a_memory_file_that_fails_its_hashes_as_it_is_read_falls_back_to_durable(tmp_path):
    mem, durable = tmp_path / "shm", tmp_path / "durable"
    policy = {"memory_every": 2, "durable_every": 2, "memory_keep_last": 1}
    saved = run_ranks(train, 2, timeout=300, env=HOST_ENV, steps=4, per_node=1, mem=str(mem), durable=str(durable),
                      policy=policy)
    for node in ("nodeA", "nodeB"):  # one bit flipped, size unchanged: chosen, then caught as it is read
        path = mem / node / "step-00000004" / "rank-00000-of-00002.safetensors"
        data = bytearray(path.read_bytes())
        data[-100] ^= 1
        path.write_bytes(bytes(data))
    results = run_ranks(resume, 2, timeout=300, env=HOST_ENV, steps=6, per_node=1, mem=str(mem), durable=str(durable))
    for rank, (start, losses, line) in enumerate(results):
        assert start == 4 and sorted(losses) == [4, 5], line
        assert f"durable tier: {durable} (step 4); memory tier skipped: step-00000004 failed: " in line, line
        assert "hash" in line and len(line.splitlines()) == 1, line
    again = run_ranks(train, 2, timeout=300, env=HOST_ENV, steps=6, per_node=1)
    assert [{s: v for s, v in r.items() if s >= 4} for r in again] == [r[1] for r in results]
    assert [{s: v for s, v in r.items() if s < 4} for r in again] == saved


def test_without_drain_the_durable_save_comes_from_the_engine_on_its_own_steps(tmp_path):
    mem, durable = tmp_path / "shm", tmp_path / "durable"
    policy = {"memory_every": 2, "durable_every": 3, "drain": False}
    run_ranks(train, 2, timeout=300, env=HOST_ENV, steps=4, per_node=1, mem=str(mem), durable=str(durable),
              policy=policy)
    assert sorted(p.name for p in durable.iterdir()) == ["latest", "step-00000003"]
    assert sorted(p.name for p in (mem / "nodeB").iterdir()) == ["job.json", "latest", "step-00000002",
                                                                     "step-00000004"]
    _cli("verify", str(durable))
    results = run_ranks(resume, 2, timeout=300, env=HOST_ENV, steps=5, per_node=1, mem=str(mem), durable=str(durable))
    assert all(start == 4 and "memory tier: step-00000004" in line for start, _, line in results), results


def refused(rank: int, world: int, mem: str, cap: int) -> str:
    _as_node(rank, 1)
    engine = _engine()
    _step(engine, 0, rank)
    ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=JOB, memory_dir=mem, memory_cap_bytes=cap))
    try:
        ckpt.save_memory()
    except CheckpointSaveError as exc:
        return str(exc)
    ckpt.wait()
    return "saved"


def test_a_memory_save_over_the_cap_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    errors = run_ranks(refused, 2, timeout=120, env=HOST_ENV, mem=str(tmp_path), cap=1000)
    for error in errors:
        assert "refused, nothing written" in error and len(error.splitlines()) == 1, error
    assert "memory_cap_bytes" in errors[0] and "rank(s) 0, 1" in errors[1] or "memory_cap_bytes" in errors[1]
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    assert run_ranks(refused, 2, timeout=120, env=HOST_ENV, mem=str(tmp_path), cap=1 << 30) == ["saved", "saved"]
    assert len(list(tmp_path.glob("node*/step-00000001/rank-*.safetensors"))) == 4


def on_dev_shm(rank: int, world: int, run_id: str) -> str:
    _as_node(rank, 1)
    os.environ["TORCHELASTIC_RUN_ID"] = run_id
    try:
        engine = _engine()
        _step(engine, 0, rank)
        ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy())
        url = ckpt.save_memory()
        ckpt.wait()
        return url
    finally:
        del os.environ["TORCHELASTIC_RUN_ID"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_the_default_memory_tier_is_on_dev_shm(tmp_path):
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    root = Path(f"/dev/shm/zeroshard-{run_id}")
    try:
        urls = run_ranks(on_dev_shm, 2, timeout=120, env=HOST_ENV, run_id=run_id)
        assert urls == [str(root / "nodeA" / "step-00000001"), str(root / "nodeB" / "step-00000001")]
        _cli("verify", str(root / "nodeB"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- a node killed in the middle of a memory save (torchrun agents, c10d rendezvous) ---------------
KILLED_TRAIN = textwrap.dedent('''
    import json, os, sys, time
    import torch
    import zeroshard
    from zeroshard.checkpointing import TierPolicy

    mem, out, steps, slow_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config={"zero_optimization": {"stage": 1}})
    ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy(memory_dir=mem, memory_every=2, durable_every=0))
    start = 0
    if os.path.isdir(mem):
        start = ckpt.load(None)["next_step"]
        with open(os.path.join(out, f"recovery-rank{rank}"), "w") as f:
            f.write(ckpt.last_recovery)
    with open(os.path.join(out, f"host-rank{rank}"), "w") as f:
        f.write(f"{os.environ['ZEROSHARD_HOST_ID']} {os.getpid()}")
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x[rank::world]), y[rank::world])
        engine.backward(loss)
        engine.step()
        with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps([step, loss.item().hex()]) + "\\n")
        if step + 1 == slow_at:  # tmpfs turned slow: the memory save is in flight when the node dies
            real = os.fsync
            os.fsync = lambda fd: (time.sleep(3.0), real(fd))[1]
        ckpt.checkpoint("", client_state={"next_step": step + 1})
        if step + 1 == slow_at:
            open(os.path.join(out, f"saving-rank{rank}"), "w").close()
    ckpt.wait()
    sys.stdout.flush()
    os._exit(0)  # no gloo teardown races at exit: everything is written
''')


def _launch(tmp: Path, name: str, args: list[str]) -> tuple[Path, list[subprocess.Popen]]:
    out = tmp / name
    out.mkdir()
    script = out / "train.py"  # one per job: the reference runs beside the killed job
    script.write_text(KILLED_TRAIN)
    port = free_port()
    agents = []
    for host in ("nodeA", "nodeB"):  # the first agent hosts the rendezvous store (said, not raced for)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "mem-job",
               "--rdzv-conf", f"is_host={int(host == 'nodeA')}", "--max-restarts", "0", str(script), args[0],
               str(out), *args[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "ZEROSHARD_HOST_ID": host}
        agents.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True))
        time.sleep(1.0)
    return out, agents


def _finish(agents: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    results = []
    deadline = time.monotonic() + timeout
    for a in agents:
        try:
            results.append((a.wait(timeout=max(1.0, deadline - time.monotonic())), a.stdout.read()))
        except subprocess.TimeoutExpired:
            for b in agents:
                _kill_node(b, [])
            raise
    return results


def _kill_node(agent: subprocess.Popen, worker_pids: list[int]) -> None:
    """SIGKILL a node: its agent's process group and its workers' (each in a session of its own)."""
    for pgid in [agent.pid, *worker_pids]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _losses(out: Path) -> dict[int, dict[int, str]]:
    return {int(p.stem[4:]): dict(map(json.loads, p.read_text().splitlines())) for p in out.glob("rank*.jsonl")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_memory_save_torn_by_a_killed_node_is_never_chosen(tmp_path):
    ref_out, ref_agents = _launch(tmp_path, "reference", [str(tmp_path / "ref-shm"), "6", "0"])  # runs beside
    try:
        mem = tmp_path / "shm"
        out, agents = _launch(tmp_path, "killed", [str(mem), "6", "4"])
        deadline = time.monotonic() + 180
        while len(list(out.glob("saving-rank*"))) < 2:
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), \
                "\n".join(t[-3000:] for _, t in _finish(agents, 5))
            time.sleep(0.05)
        time.sleep(0.5)  # inside the slowed write of step 4's files
        pids = {host: int(pid) for host, pid in (p.read_text().split() for p in out.glob("host-rank*"))}
        _kill_node(agents[1], [pids["nodeB"]])
        agents[1].wait()
        (rc, text), = _finish(agents[:1], 120)
        assert rc != 0, text[-3000:]
        for node in ("nodeA", "nodeB"):  # torn on both: no manifest anywhere
            assert not (mem / node / "step-00000004" / "zeroshard.json").exists()
        assert (mem / "nodeA" / "latest").read_text().strip() == "step-00000002"
    except BaseException:
        for agent in ref_agents:
            _kill_node(agent, [])
        raise
    results = _finish(ref_agents, 240)
    assert all(rc == 0 for rc, _ in results), "\n".join(t[-3000:] for _, t in results)
    reference = _losses(ref_out)
    out, agents = _launch(tmp_path, "restarted", [str(mem), "6", "0"])
    results = _finish(agents, 240)
    assert all(rc == 0 for rc, _ in results), "\n".join(t[-3000:] for _, t in results)
    for rank in (0, 1):
        line = (out / f"recovery-rank{rank}").read_text()
        assert "memory tier: step-00000002 (step 2), every file from its own node" in line, line
        assert "step-00000004 torn (no manifest)" in line, line
    assert _losses(out) == {r: {s: v for s, v in steps.items() if s >= 2} for r, steps in reference.items()}
    _cli("verify", str(mem / "nodeB"))
