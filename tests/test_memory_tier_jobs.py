"""One job per memory folder (issue 26, [Note: one job per folder] in memory_tier.py): two jobs on
one node must never load, prune or overwrite each other's memory checkpoints, and a job that
cannot say which job it is gets no memory tier. Then failure domains through a Checkpointer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_memory_tier import HOST_ENV, _as_node, _cli, _engine, _fill, _hashes, _step

import zeroshard
from zeroshard.checkpointing import TierPolicy
from zeroshard.checkpointing.memory_tier import OWNER_NAME, MemoryFolder
from zeroshard.checkpointing.recovery import candidates_of
from zeroshard.errors import CheckpointSaveError, ConfigError

from distributed import RankError, run_ranks

TIER = "mixed"  # docs/TESTING.md


# ---- without launches ---------------------------------------------------------------------------
def test_a_memory_tier_that_cannot_name_its_job_is_refused(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for run_id in (None, "none"):  # torchrun's default --rdzv-id is shared by unrelated jobs
        if run_id:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        with pytest.raises(ConfigError, match=r"--rdzv-id .* TierPolicy\(job=\.\.\.\)") as err:
            TierPolicy().root()
        assert len(str(err.value).splitlines()) == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-7")
    assert TierPolicy().job_name() == "run-7" and TierPolicy(job="mine").job_name() == "mine"
    assert TierPolicy(job="a").root() == "/dev/shm/zeroshard-a" != TierPolicy(job="b").root()
    odd = TierPolicy(job="s3://bucket/run 1").root()  # any name: a digest when it cannot name a folder
    assert odd.startswith("/dev/shm/zeroshard-job-") and "/" not in odd[len("/dev/shm/"):]
    assert TierPolicy(job="x", memory_dir="/tmp/m").root() == "/tmp/m"
    for bad in ("", "  ", 7):
        with pytest.raises(ConfigError, match="TierPolicy.job"):
            TierPolicy(job=bad)


def test_a_folder_belongs_to_the_job_that_claimed_it_first(tmp_path):
    a, b = MemoryFolder(str(tmp_path), "nodeA", "job-a"), MemoryFolder(str(tmp_path), "nodeA", "job-b")
    assert a.owner() is None and a.foreign_owner() is None
    a.claim()
    a.claim()  # again, and from every rank of the node: the same job
    owner_file = tmp_path / "nodeA" / OWNER_NAME
    before = owner_file.read_bytes()
    with pytest.raises(CheckpointSaveError) as err:
        b.claim()
    message = str(err.value)
    assert len(message.splitlines()) == 1 and str(tmp_path / "nodeA") in message
    assert "belongs to job 'job-a', not to this job 'job-b'; nothing written" in message
    assert owner_file.read_bytes() == before and b.foreign_owner() == "job-a" and a.foreign_owner() is None
    owner_file.write_text("{not json")  # an owner file nobody can read belongs to no job that asks
    for folder in (a, b):
        with pytest.raises(CheckpointSaveError, match="unreadable"):
            folder.claim()


def test_pruning_and_the_recovery_choice_see_only_this_jobs_checkpoints(tmp_path):
    node = tmp_path / "nodeA"
    _fill(node, "step-00000002", 100, job="job-a")
    _fill(node, "step-00000004", 100, job="job-a")
    _fill(node, "step-00000006", 100, job="job-b")  # copied in by hand, say: never this job's
    _fill(node, "step-00000008", 100, job=None)  # records no job
    a = MemoryFolder(str(tmp_path), "nodeA", "job-a")
    doomed, kept = a.doomed("step-00000010", keep_last=2)
    assert doomed == ["step-00000002"] and [c.tag for c in kept] == ["step-00000004"]
    found, notes = candidates_of(a)
    assert [c.tag for c in found] == ["step-00000002", "step-00000004"]
    assert "step-00000006 is job 'job-b''s" in notes and "step-00000008 records no job" in notes
    with pytest.raises(CheckpointSaveError, match="step-00000006: a memory checkpoint of job 'job-b' is there"):
        a.doomed("step-00000006", keep_last=2)  # a save of that tag would write into it
    assert (node / "step-00000006" / "zeroshard.json").exists()


# ---- two nodes of gloo ranks --------------------------------------------------------------------
def job_run(rank: int, world: int, job: str | None, mem: str | None, durable: str, steps: int,
            load: bool = False) -> dict[str, Any]:
    """A job named `job` on 2 nodes: optionally load first, then `steps` steps with
    Checkpointer.checkpoint() after each; reports how far it got and what it was told."""
    _as_node(rank, 1)
    engine = _engine()
    out: dict[str, Any] = {}
    try:
        ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy(job=job, memory_dir=mem, memory_every=2,
                                                               durable_every=4))
    except ConfigError as exc:
        return {"refused": str(exc)}
    start = 0
    if load:
        start = ckpt.load(durable)["next"]
        out["recovery"] = ckpt.last_recovery
    try:
        for step in range(start, start + steps):
            _step(engine, step, rank)
            ckpt.checkpoint(durable, client_state={"next": step + 1})
        ckpt.wait()
    except CheckpointSaveError as exc:
        out["refused"] = str(exc)
    out["start"] = start
    return out


@pytest.mark.timeout(600)
def test_a_second_job_on_the_same_memory_dir_takes_nothing_and_the_first_recovers_intact(tmp_path):
    mem, durable_a = tmp_path / "shm", tmp_path / "durable-a"
    run_ranks(job_run, 2, timeout=300, env=HOST_ENV, job="job-a", mem=str(mem), durable=str(durable_a), steps=6)
    before = _hashes(mem)
    assert sorted(p.name for p in (mem / "nodeA").iterdir()) == [OWNER_NAME, "latest", "step-00000004",
                                                                  "step-00000006"]
    # job B, launched on the same nodes with the same memory_dir, resumes from job A's durable root
    # (a copy of a run, say): it must not load A's newer memory checkpoint, nor prune or overwrite it
    results = run_ranks(job_run, 2, timeout=300, env=HOST_ENV, job="job-b", mem=str(mem), durable=str(durable_a),
                        steps=4, load=True)
    for out in results:
        assert out["start"] == 4, out
        assert f"recovered from the durable tier: {durable_a} (step 4)" in out["recovery"], out
        assert "belongs to job 'job-a', not this job 'job-b'" in out["recovery"], out
        assert "belongs to job 'job-a', not to this job 'job-b'; nothing written" in out["refused"], out
    assert _hashes(mem) == before  # job A's memory tier, byte for byte
    # job A relaunched (same name) recovers its own newest memory checkpoint, every file local
    results = run_ranks(job_run, 2, timeout=300, env=HOST_ENV, job="job-a", mem=str(mem), durable=str(durable_a),
                        steps=2, load=True)
    for out in results:
        assert "recovered from the memory tier: step-00000006 (step 6), every file from its own node" \
               in out["recovery"] and out["start"] == 6 and "refused" not in out, out
    _cli("verify", str(mem / "nodeB"))


@pytest.mark.timeout(300)
def test_a_job_with_no_name_and_no_run_id_gets_no_memory_tier(tmp_path):
    results = run_ranks(job_run, 2, timeout=200, env={**HOST_ENV, "TORCHELASTIC_RUN_ID": "none"}, job=None, mem=None,
                        durable=str(tmp_path / "durable"), steps=2)
    for out in results:  # refused alike on every rank, before any folder exists
        assert "the memory tier needs to know which job it belongs to" in out["refused"], out


def named_differently(rank: int, world: int) -> None:
    _as_node(rank, 1)
    zeroshard.Checkpointer(_engine(), tiers=TierPolicy(job=f"job-{rank}", memory_dir=os.environ["MEM"]))


@pytest.mark.timeout(300)
def test_ranks_that_name_different_jobs_are_refused_on_every_rank(tmp_path):
    with pytest.raises(RankError) as err:
        run_ranks(named_differently, 2, timeout=200, env={**HOST_ENV, "MEM": str(tmp_path)})
    assert str(err.value).count("ConfigError: the ranks name different jobs for the memory tier") == 2, str(err.value)
    assert not any(tmp_path.iterdir())


# ---- failure domains, launched through a Checkpointer -------------------------------------------
RACKS = {0: "rack1", 1: "rack1", 2: "rack2"}  # nodes A and B share a rack; C stands alone


def in_racks(rank: int, world: int, mem: str) -> list[str]:
    os.environ["ZEROSHARD_HOST_ID"] = f"node{'ABC'[rank]}"
    os.environ["ZEROSHARD_DOMAIN"] = RACKS[rank]
    try:
        engine = _engine()
        _step(engine, 0, rank)
        ckpt = zeroshard.Checkpointer(engine, tiers=TierPolicy(job="racks", memory_dir=mem, replicas=1))
        url = ckpt.save_memory()
        ckpt.wait()
        return sorted(p.name for p in Path(url).glob("rank-*.safetensors"))
    finally:
        del os.environ["ZEROSHARD_DOMAIN"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_copies_land_in_another_rack_when_launched_through_a_checkpointer(tmp_path):
    held = run_ranks(in_racks, 3, timeout=200, env=HOST_ENV, mem=str(tmp_path))
    names = [f"rank-0000{r}-of-00003.safetensors" for r in range(3)]
    # every file is also in the other rack: node C keeps the copies of A's and B's ranks; C's own
    # file has one copy, on A or B
    assert held[2] == names, held
    assert sum(names[2] in h for h in held[:2]) == 1 and all(names[r] in held[r] for r in range(2)), held
    assert names[0] not in held[1] and names[1] not in held[0]  # never a copy in the same rack
    owner = json.loads((tmp_path / "nodeC" / OWNER_NAME).read_text())
    assert owner == {"job": "racks"}
    for node in ("nodeA", "nodeB", "nodeC"):
        manifest = json.loads((tmp_path / node / "step-00000001" / "zeroshard.json").read_text())
        assert manifest["extra"]["memory_tier"] == {"job": "racks"}
