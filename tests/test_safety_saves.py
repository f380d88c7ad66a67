"""One writer per checkpoint tag and per toolkit output: an atomic claim before any byte is
written, the loser refused with a clear error on every rank; pruning never follows links."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner
from test_checkpoint_engine import run

from zeroshard.cli import main
from zeroshard.storage import Location
from zeroshard.storage.claim import CLAIM_NAME, STALE_CLAIM_S, ClaimError, take_claim

from checkpoints import training_state, write_checkpoint
from distributed import run_ranks

TIER = "mixed"  # docs/TESTING.md

TAG = "step-00000001"


# ---- the claim itself --------------------------------------------------------------------------
def _race(url: str, barrier, results) -> None:
    barrier.wait()
    try:
        take_claim(Location(url))
        results.put("won")
    except ClaimError as exc:
        results.put(f"lost: {exc}")


def _race_claims(url: str, contenders: int = 4) -> list[str]:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(contenders), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(url, barrier, results)) for _ in range(contenders)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return outcomes


@pytest.mark.slow
def test_of_racing_writers_exactly_one_claims_the_folder(tmp_path):
    for round_ in range(3):
        outcomes = _race_claims(str(tmp_path / f"out{round_}"))
        assert outcomes.count("won") == 1, outcomes
        assert all("being written by another zeroshard process" in o for o in outcomes if o != "won")


@pytest.mark.s3
def test_of_racing_writers_exactly_one_claims_an_s3_prefix(s3_bucket):
    """S3: the conditional PUT (If-None-Match: *) decides; moto honours it as S3 does."""
    outcomes = _race_claims(f"{s3_bucket}/out")
    assert outcomes.count("won") == 1, outcomes


def test_claims_of_dead_or_old_writers_are_taken_over_live_ones_are_not(tmp_path):
    loc = Location(str(tmp_path / "out"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    from zeroshard.storage.owner import host_id
    body = {"owner": f"{host_id()}.{int(dead.stdout)}", "time": time.time(), "nonce": "x"}
    loc.makedirs()
    (tmp_path / "out" / CLAIM_NAME).write_text(json.dumps(body))
    take_claim(loc).release()  # its owner is gone: taken over
    assert not (tmp_path / "out" / CLAIM_NAME).exists()
    other_host = {"owner": "ffffffff.1", "time": time.time(), "nonce": "y"}
    (tmp_path / "out" / CLAIM_NAME).write_text(json.dumps(other_host))
    with pytest.raises(ClaimError, match="another zeroshard process"):
        take_claim(loc)  # another host's recent claim: cannot tell, refuse
    (tmp_path / "out" / CLAIM_NAME).write_text(json.dumps({**other_host, "time": time.time() - STALE_CLAIM_S - 1}))
    take_claim(loc).release()  # ... unless it is older than any run
    held = take_claim(loc)
    with pytest.raises(ClaimError):
        take_claim(loc)  # a live claim (this very process) is never taken over
    held.release()
    assert not (tmp_path / "out" / CLAIM_NAME).exists()


def test_a_toolkit_output_being_written_is_refused(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ckpt"), specs, data, 2)
    held = take_claim(Location(str(tmp_path / "out")))
    for args in (["reshard", "-q", str(tmp_path / "ckpt"), "--to", "1", "-o", str(tmp_path / "out")],
                 ["consolidate", "-q", str(tmp_path / "ckpt"), str(tmp_path / "out")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and "being written by another zeroshard process" in result.output, result.output
        assert CLAIM_NAME in result.output and len(result.output.strip().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [CLAIM_NAME]
    held.release()
    result = CliRunner().invoke(main, ["reshard", "-q", str(tmp_path / "ckpt"), "--to", "1", "-o",
                                       str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "out" / CLAIM_NAME).exists()  # released after the commit


# ---- engine saves --------------------------------------------------------------------------------
def test_a_save_whose_tag_another_job_is_writing_fails_on_every_rank(tmp_path):
    root = tmp_path / "run"
    held = take_claim(Location(str(root / TAG)), "checkpoint tag")  # "the other job", alive: this process
    outs = run_ranks(run, 2, timeout=240, stage=2, steps=1, ckpt=str(root), save_at=(1,))
    for out in outs:
        assert (len(out["errors"]) == 1
                and "being written by another zeroshard process" in out["errors"][0]), out["errors"]
    assert sorted(p.name for p in (root / TAG).iterdir()) == [CLAIM_NAME]  # no rank wrote a byte
    assert not (root / "latest").exists()
    held.release()
    outs = run_ranks(run, 2, timeout=240, stage=2, steps=1, ckpt=str(root), save_at=(1,))
    assert all(not out["errors"] for out in outs)
    assert sorted(p.name for p in (root / TAG).iterdir()) == [
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "zeroshard.json"]
    assert CliRunner().invoke(main, ["verify", "-q", str(root)]).exit_code == 0


def test_keep_last_never_follows_a_link_out_of_the_root(tmp_path):
    elsewhere, root = tmp_path / "elsewhere", tmp_path / "run"
    run_ranks(run, 2, timeout=240, stage=1, steps=1, ckpt=str(elsewhere), save_at=(1,))
    root.mkdir()
    (root / "aaa-link").symlink_to(elsewhere / TAG)  # a committed checkpoint elsewhere, step 1
    outs = run_ranks(run, 2, timeout=240, stage=1, steps=3, ckpt=str(root), save_at=(1, 2, 3), keep_last=1)
    assert all(not out["errors"] for out in outs)
    assert sorted(p.name for p in root.iterdir()) == ["aaa-link", "latest", "step-00000003"]
    assert (root / "aaa-link").is_symlink()
    result = CliRunner().invoke(main, ["verify", "-q", str(elsewhere / TAG)])
    assert result.exit_code == 0, result.output


def test_a_save_takes_over_a_killed_save_of_its_tag_and_removes_its_leftovers(tmp_path):
    from zeroshard.storage.owner import host_id

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = f"{host_id()}.{int(dead.stdout)}"
    folder = tmp_path / "run" / TAG
    folder.mkdir(parents=True)
    (folder / CLAIM_NAME).write_text(json.dumps({"owner": owner, "time": time.time(), "nonce": "killed"}))
    (folder / f".zeroshard-tmp-{owner}-abcd1234-rank-00000-of-00002.safetensors").write_bytes(b"\0" * 4096)
    (folder / "rank-00001-of-00002.safetensors").write_bytes(b"half a file from the killed save")
    outs = run_ranks(run, 2, timeout=240, stage=2, steps=1, ckpt=str(tmp_path / "run"), save_at=(1,))
    assert all(not out["errors"] for out in outs), [out["errors"] for out in outs]
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "zeroshard.json"]
    assert CliRunner().invoke(main, ["verify", "-q", str(tmp_path / "run")]).exit_code == 0


def test_a_save_into_a_tag_that_is_a_link_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / TAG).symlink_to(elsewhere)
    outs = run_ranks(run, 2, timeout=240, stage=1, steps=1, ckpt=str(tmp_path / "run"), save_at=(1,))
    for out in outs:
        assert len(out["errors"]) == 1 and "symbolic link" in out["errors"][0] and TAG in out["errors"][0]
    assert list(elsewhere.iterdir()) == []
