"""A claim's heartbeat: while its writer runs, the claim's `beat` time is refreshed, so a claim of
another host whose writer is gone (a node lost with rank 0) is taken over once silent for
SILENT_CLAIM_S instead of after 6 hours, and a long write is never taken over however old its
claim. A writer whose claim was taken over anyway (a paused process) never commits."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.errors import ClaimError
from zeroshard.storage import Location
from zeroshard.storage import claim as claim_module
from zeroshard.storage.claim import CLAIM_NAME, SILENT_CLAIM_S, STALE_CLAIM_S, take_claim
from zeroshard.storage.owner import host_id, owner_alive

from distributed import run_ranks

TIER = "default"  # docs/TESTING.md

OTHER_HOST = "ffffffff.12345"  # an owner whose process this host cannot see


def _leave_claim(folder: Path, **fields) -> bytes:
    folder.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"owner": OTHER_HOST, "time": time.time(), "nonce": "theirs", **fields}).encode()
    (folder / CLAIM_NAME).write_bytes(body)
    return body


def _doc(folder: Path) -> dict:
    return json.loads((folder / CLAIM_NAME).read_bytes())


def test_a_held_claim_beats_until_released_and_never_after(tmp_path, monkeypatch):
    monkeypatch.setattr(claim_module, "HEARTBEAT_S", 0.05)
    claim = take_claim(Location(str(tmp_path / "out")))
    first = _doc(tmp_path / "out")
    assert first["beat"] == first["time"]
    time.sleep(0.4)
    beaten = _doc(tmp_path / "out")
    assert beaten["nonce"] == claim.nonce and beaten["beat"] > first["beat"] + 0.1
    claim.release()
    time.sleep(0.3)  # a beat in flight at release must not bring the claim back
    assert not (tmp_path / "out" / CLAIM_NAME).exists()
    assert not claim.heartbeat._thread.is_alive()


def test_a_torn_claim_stops_beating(tmp_path, monkeypatch):
    monkeypatch.setattr(claim_module, "HEARTBEAT_S", 0.05)
    claim = take_claim(Location(str(tmp_path / "out")))
    claim.mark_torn()
    torn = (tmp_path / "out" / CLAIM_NAME).read_bytes()
    time.sleep(0.3)
    assert (tmp_path / "out" / CLAIM_NAME).read_bytes() == torn and "torn" in json.loads(torn)


@pytest.mark.parametrize("case, taken", [
    ("beating", False),            # its writer beat a moment ago: alive, whatever host
    ("old but beating", False),    # a write longer than 6 hours is still never taken over
    ("silent", True),              # no beat for SILENT_CLAIM_S: its writer is gone
    ("no beat, young", False),     # an earlier zeroshard's claim: the 6-hour rule, as before
    ("no beat, old", True),
    ("this host, pid reused", True),  # a live pid that does not beat is not the writer's
    ("beat in the future", False),  # a clock ahead of ours proves nothing
    ("beat not a number", False),
])
def test_a_claim_is_taken_over_once_silent(tmp_path, caplog, case, taken):
    assert owner_alive(f"{host_id()}.1") is True  # pid 1 is always there
    now = time.time()
    fields = {"beating": {"beat": now - 30},
              "old but beating": {"time": now - STALE_CLAIM_S - 60, "beat": now - 30},
              "silent": {"time": now - SILENT_CLAIM_S - 90, "beat": now - SILENT_CLAIM_S - 60},
              "no beat, young": {"time": now - SILENT_CLAIM_S - 60},
              "no beat, old": {"time": now - STALE_CLAIM_S - 60},
              "this host, pid reused": {"owner": f"{host_id()}.1", "beat": now - SILENT_CLAIM_S - 60},
              "beat in the future": {"beat": now + 3600},
              "beat not a number": {"beat": "soon", "time": now - SILENT_CLAIM_S - 60}}[case]
    before = _leave_claim(tmp_path / "t", **fields)
    loc = Location(str(tmp_path / "t"))
    if not taken:
        with pytest.raises(ClaimError, match="being written by another zeroshard process") as err:
            take_claim(loc)
        if case == "beating":
            assert "last heartbeat 30 s ago" in str(err.value)
        assert (tmp_path / "t" / CLAIM_NAME).read_bytes() == before  # untouched
        return
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        claim = take_claim(loc)
    assert claim.took_over and _doc(tmp_path / "t")["nonce"] == claim.nonce
    if case in ("silent", "this host, pid reused"):
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "no heartbeat for" in lines[0] and fields.get("owner", OTHER_HOST) in lines[0], lines
    claim.release()


def test_a_writer_whose_claim_was_taken_over_neither_beats_over_it_nor_commits(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(claim_module, "HEARTBEAT_S", 0.05)
    claim = take_claim(Location(str(tmp_path / "out")), "output")
    claim.check_held()  # still ours
    successor = _leave_claim(tmp_path / "out", nonce="successor")  # took it while we were paused
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        time.sleep(0.3)
    assert (tmp_path / "out" / CLAIM_NAME).read_bytes() == successor  # no beat written over it
    assert any("taken over or removed" in r.getMessage() for r in caplog.records)
    with pytest.raises(ClaimError, match=f"taken over by owner {OTHER_HOST}.*nothing committed"):
        claim.check_held()
    claim.release()
    assert (tmp_path / "out" / CLAIM_NAME).read_bytes() == successor
    (tmp_path / "out" / CLAIM_NAME).unlink()  # `zeroshard clean --older-than 0s` ran meanwhile
    with pytest.raises(ClaimError, match="claim was removed"):
        claim.check_held()


def _hijacked_reshard(ckpt: Path, out: Path) -> str:
    """A reshard whose claim passes to another host's writer once it has claimed its output (it
    was paused there)."""
    from zeroshard.toolkit import reshard

    real = reshard.prepare_output

    def prepare_output(*args, **kwargs):
        prepared = real(*args, **kwargs)
        _leave_claim(out, nonce="successor")
        return prepared

    reshard.prepare_output = prepare_output
    try:
        return CliRunner().invoke(main, ["reshard", str(ckpt), str(out), "--to", "3"]).output
    finally:
        reshard.prepare_output = real


def test_a_toolkit_output_whose_claim_was_taken_over_is_not_committed(tmp_path):
    from checkpoints import training_state, write_checkpoint

    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ck"), specs, data, 2)
    output = _hijacked_reshard(tmp_path / "ck", tmp_path / "out")
    assert "taken over by owner" in output and "Traceback" not in output, output
    assert not (tmp_path / "out" / "zeroshard.json").exists()
    assert _doc(tmp_path / "out")["nonce"] == "successor"  # the successor's claim stays


def hijacked_save(rank: int, world: int, root: str) -> str:
    """An engine save whose tag's claim passes to another host's job while the ranks write."""
    import torch

    import zeroshard
    from zeroshard.checkpointing import save as save_module

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                  config={"zero_optimization": {"stage": 1}})
    real = save_module.write_rank_file

    def write_rank_file(*args, **kwargs):
        result = real(*args, **kwargs)
        if rank == 0:
            _leave_claim(Path(root) / "step-1", nonce="successor")
        return result

    save_module.write_rank_file = write_rank_file
    try:
        engine.save_checkpoint(root, tag="step-1")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        save_module.write_rank_file = real
    return "saved"


def test_an_engine_save_whose_claim_was_taken_over_is_not_committed(tmp_path):
    outcomes = run_ranks(hijacked_save, 2, root=str(tmp_path / "run"), timeout=120)
    assert all(o.startswith("CheckpointSaveError") for o in outcomes), outcomes
    assert "taken over by owner" in outcomes[0], outcomes
    assert not (tmp_path / "run" / "step-1" / "zeroshard.json").exists()
    assert not (tmp_path / "run" / "latest").exists()
    assert _doc(tmp_path / "run" / "step-1")["nonce"] == "successor"  # not marked torn: not ours


def test_clean_judges_another_hosts_claim_by_its_heartbeat(tmp_path):
    now = time.time()
    _leave_claim(tmp_path / "silent", beat=now - SILENT_CLAIM_S - 60)
    (tmp_path / "silent" / "rank-00000-of-00002.safetensors").write_bytes(b"x" * 100)
    _leave_claim(tmp_path / "beating", time=now - 7200, beat=now - 20)  # a 2-hour write, alive
    (tmp_path / "beating" / "rank-00000-of-00002.safetensors").write_bytes(b"y" * 100)
    result = CliRunner().invoke(main, ["clean", str(tmp_path), "--older-than", "1d", "--yes"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "silent").exists()  # silent: stale whatever --older-than says
    assert sorted(p.name for p in (tmp_path / "beating").iterdir()) == [CLAIM_NAME, "rank-00000-of-00002.safetensors"]
    result = CliRunner().invoke(main, ["clean", str(tmp_path), "--yes"])  # the default, 1 h: a beat is recent
    assert (tmp_path / "beating" / CLAIM_NAME).exists(), result.output


@pytest.mark.s3
def test_a_claim_on_s3_beats_and_is_checked_before_commit(s3_bucket, monkeypatch):
    monkeypatch.setattr(claim_module, "HEARTBEAT_S", 0.2)
    loc = Location(f"{s3_bucket}/out")
    claim = take_claim(loc)
    try:
        first = json.loads(loc.read_bytes(CLAIM_NAME))
        deadline = time.time() + 10
        while json.loads(loc.read_bytes(CLAIM_NAME))["beat"] == first["beat"] and time.time() < deadline:
            time.sleep(0.1)
        assert json.loads(loc.read_bytes(CLAIM_NAME))["beat"] > first["beat"]
        claim.check_held()
        # The beat reads, then writes: a takeover landing between the two is overwritten (and then
        # the taker's check_held refuses, so one writer still commits). Stopped here, so that the
        # takeover below is not lost to that window; the beat's own refusal is checked after it.
        claim.heartbeat.stop()
        loc.write_bytes(CLAIM_NAME, json.dumps({"owner": OTHER_HOST, "time": time.time(), "nonce": "x"}).encode())
        with pytest.raises(ClaimError, match="taken over"):
            claim.check_held()
        assert claim._beat() is False  # a beat stops once the claim is not its writer's
    finally:
        claim.release()
    assert json.loads(loc.read_bytes(CLAIM_NAME))["nonce"] == "x"


def test_ls_says_what_a_claim_tells_of_its_writer(tmp_path):
    from zeroshard.storage.owner import owner_tag

    now = time.time()
    _leave_claim(tmp_path / "beating", beat=now - 20)
    _leave_claim(tmp_path / "silent", beat=now - SILENT_CLAIM_S - 60)
    _leave_claim(tmp_path / "mine", owner=owner_tag())  # this process: alive
    _leave_claim(tmp_path / "older", time=now - 60)  # an earlier zeroshard's: no beat
    result = CliRunner().invoke(main, ["ls", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    problems = {e["name"]: e["problem"] for e in json.loads(result.output)["checkpoints"]}
    assert problems["beating"].endswith("being written on another host (last heartbeat 20 s ago)"), problems
    assert problems["silent"].endswith("its writer is gone (zeroshard clean removes it)"), problems
    assert problems["mine"].endswith("no zeroshard.json: being written"), problems
    assert problems["older"].endswith("being written, or its writer was killed (zeroshard clean tells which and "
                                      "removes it then)"), problems
