"""S3 faults, injected by a proxy in front of moto (s3_fault_proxy): a dropped upload, a failing
read, a failing commit, the network gone mid-upload, a server that never answers. In each: no
half-written object becomes visible, the old output keeps every byte until the new one commits,
the command fails within its retry budget (zeroshard_retry_s), and what the fault left is removed
by the command itself or, if S3 could not be reached, by `zeroshard clean`."""

from __future__ import annotations

import hashlib
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter

import pytest
from click.testing import CliRunner

from zeroshard.cli import main

from checkpoints import training_state, write_checkpoint
from s3_fault_proxy import FaultProxy

TIER = "mixed"  # docs/TESTING.md

pytestmark = pytest.mark.s3


BUDGET_S = 3.0  # zeroshard_retry_s in the tests that time the failure
SLACK_S = 5.0  # clean-up after the budget is spent (abort, stage, claim), on a busy test machine


@pytest.fixture
def proxy(s3_endpoint):
    p = FaultProxy(s3_endpoint)
    yield p
    p.close()


def via(proxy: FaultProxy, retry_s: float = 1.0) -> list[str]:
    """Options for a run through the proxy: faults are retried for `retry_s` seconds, then final."""
    return ["-S", f"endpoint_url={proxy.url}", "-S", "skip_instance_cache=true", "-S", "zeroshard_part_size=5MiB",
            "-S", f"zeroshard_retry_s={retry_s:g}"]


def objects(client, bucket: str, prefix: str) -> dict[str, str]:
    out = {}
    for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
        out[item["Key"]] = hashlib.sha256(client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()).hexdigest()
    return out


def pending(client, bucket: str) -> list[str]:
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


@pytest.fixture
def old_output(tmp_path, s3_bucket, s3_client):
    """A local checkpoint and its earlier reshard on S3 (the output we must not lose). Rank files
    of ~8 MB, so that an upload (5 MiB parts, see via) is a real multipart upload."""
    import torch

    from zeroshard.format.writer import TensorSpec

    specs, data = training_state()
    specs.append(TensorSpec("big.weight", "param", "F32", (6_000_000,)))
    data["big.weight"] = torch.arange(6_000_000, dtype=torch.float32)
    write_checkpoint(str(tmp_path / "ckpt"), specs, data, 3)
    out = f"{s3_bucket}/out"
    result = CliRunner().invoke(main, ["reshard", "-q", str(tmp_path / "ckpt"), "--to", "2", "-o", out])
    assert result.exit_code == 0, result.output
    bucket = s3_bucket[len("s3://"):]
    return tmp_path / "ckpt", out, bucket, objects(s3_client, bucket, "out/")


def one_line_failure(result, *needles):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output


@pytest.mark.slow
def test_dropped_upload_keeps_old_output_and_clean_aborts_the_pending_upload(proxy, old_output, s3_client):
    ckpt, out, bucket, before = old_output

    def rule(method, path, query):
        if method == "PUT" and "partNumber=" in query and "/out/" in path:
            return ("drop", 100)  # the connection dies 100 bytes into the part
        if method == "DELETE" and "uploadId=" in query:
            return ("drop", 0)  # ... and stays dead: the abort cannot get through either
        return None

    proxy.rule = rule
    result = CliRunner().invoke(main, ["reshard", "-q", "--overwrite", str(ckpt), "--to", "3", "-o", out, *via(proxy)])
    one_line_failure(result, out)
    assert any(fault == ("drop", 100) for *_, fault in proxy.requests)  # the fault did happen
    assert objects(s3_client, bucket, "out/") == before  # no new object visible, not a byte of the old one changed
    assert CliRunner().invoke(main, ["verify", "-q", out]).exit_code == 0
    left = pending(s3_client, bucket)
    assert left and all(key.startswith("out/.zeroshard-tmp-") for key in left), left

    listing = CliRunner().invoke(main, ["clean", f"s3://{bucket}", "--older-than", "0s"])
    assert listing.exit_code == 0 and "stale multipart upload" in listing.output, listing.output
    assert pending(s3_client, bucket) == left  # a dry run removes nothing
    result = CliRunner().invoke(main, ["clean", f"s3://{bucket}", "--older-than", "0s", "--yes"])
    assert result.exit_code == 0 and "removed multipart upload" in result.output, result.output
    assert pending(s3_client, bucket) == []
    assert objects(s3_client, bucket, "out/") == before


@pytest.mark.slow
def test_the_next_run_into_the_output_aborts_a_dead_runs_pending_uploads(proxy, old_output, s3_client):
    ckpt, out, bucket, before = old_output
    proxy.rule = lambda m, p, q: (("drop", 100) if (m == "PUT" and "partNumber=" in q)
                                  or (m == "DELETE" and "uploadId=" in q) else None)
    result = CliRunner().invoke(main, ["reshard", "-q", "--overwrite", str(ckpt), "--to", "3", "-o", out, *via(proxy)])
    one_line_failure(result, out)
    assert pending(s3_client, bucket)
    result = CliRunner().invoke(main, ["reshard", "-q", "--overwrite", str(ckpt), "--to", "3", "-o", out])
    assert result.exit_code == 0, result.output
    assert pending(s3_client, bucket) == []
    keys = objects(s3_client, bucket, "out/")
    assert sorted(keys) == ["out/rank-00000-of-00003.safetensors", "out/rank-00001-of-00003.safetensors",
                            "out/rank-00002-of-00003.safetensors", "out/zeroshard.json"]
    assert CliRunner().invoke(main, ["verify", "-q", out, "-S", "skip_instance_cache=true"]).exit_code == 0


@pytest.mark.slow
def test_failing_read_mid_overwrite_leaves_nothing_behind(tmp_path, proxy, old_output, s3_client, s3_bucket):
    ckpt, out, bucket, before = old_output
    # the input on S3 too, its last rank file unreadable (HTTP 500) once the copy is under way
    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/in", specs, data, 3)
    proxy.rule = lambda m, p, q: (("status", 500) if m == "GET" and p.endswith("/in/rank-00002-of-00003.safetensors")
                                  else None)
    result = CliRunner().invoke(main, ["reshard", "-q", "--overwrite", f"{s3_bucket}/in", "--to", "3", "-o", out,
                                       *via(proxy)])
    one_line_failure(result, "rank-00002-of-00003.safetensors")
    assert objects(s3_client, bucket, "out/") == before
    assert pending(s3_client, bucket) == []  # the failed uploads were aborted
    assert CliRunner().invoke(main, ["verify", "-q", out]).exit_code == 0


@pytest.mark.slow
def test_failing_commit_keeps_the_new_output_recoverable(proxy, old_output, s3_client):
    """The fault hits after the swap began (the old manifest is gone): the new output is then
    whole across the stage and the folder, clean keeps the stage, and moving it up recovers."""
    ckpt, out, bucket, before = old_output
    # the manifest's upload fails: its single PUT (small) or its multipart completion (POST)
    proxy.rule = lambda m, p, q: ("status", 500) if m in ("PUT", "POST") and p.endswith("/out/zeroshard.json") else None
    result = CliRunner().invoke(main, ["reshard", "-q", "--overwrite", str(ckpt), "--to", "3", "-o", out, *via(proxy)])
    one_line_failure(result, "out/zeroshard.json")
    keys = objects(s3_client, bucket, "out/")
    stage = {k.split("/")[1] for k in keys if k.startswith("out/.zeroshard-tmp-")}
    assert len(stage) == 1, keys
    stage_dir = stage.pop()
    assert f"out/{stage_dir}/zeroshard.json" in keys
    listing = CliRunner().invoke(main, ["clean", f"s3://{bucket}", "--older-than", "0s", "--yes"])
    assert "kept staging folder" in listing.output and "interrupted" in listing.output, listing.output
    assert objects(s3_client, bucket, f"out/{stage_dir}/").keys() >= {f"out/{stage_dir}/zeroshard.json"}
    # recovery as docs/SAFETY.md says: move the stage's files up
    s3_client.copy_object(Bucket=bucket, Key="out/zeroshard.json",
                          CopySource={"Bucket": bucket, "Key": f"out/{stage_dir}/zeroshard.json"})
    result = CliRunner().invoke(main, ["verify", "-q", out, "-S", "skip_instance_cache=true"])  # no cached listing
    assert result.exit_code == 0, result.output


def reshard_over(ckpt, out: str, *options: str) -> list[str]:
    return ["reshard", "-q", "--overwrite", str(ckpt), "--to", "3", "-o", out, *options]


@pytest.mark.slow
@pytest.mark.exclusive
def test_connections_dropping_mid_upload_fail_within_the_budget_and_leave_nothing(proxy, old_output, s3_client):
    """Every part upload's connection dies: retried for the budget, then one line; the upload is
    aborted and the claim released, so a plain re-run works."""
    ckpt, out, bucket, before = old_output
    proxy.rule = lambda m, p, q: ("drop", 100) if m == "PUT" and "partNumber=" in q else None
    result = CliRunner().invoke(main, reshard_over(ckpt, out, *via(proxy, BUDGET_S)))
    took = time.monotonic() - proxy.faulted_at[0]
    one_line_failure(result, out, f" s (zeroshard_retry_s={BUDGET_S:g})")
    gave_up = re.search(r"gave up after (\d+\.\d) s", result.output)  # the time it really took
    assert gave_up and BUDGET_S <= float(gave_up.group(1)) < BUDGET_S + SLACK_S, result.output
    assert "pending" not in result.output, result.output  # the abort got through
    assert BUDGET_S <= took < BUDGET_S + SLACK_S, took
    tries = Counter(r[1] for r in proxy.requests if r[3] and "partNumber=1&" in r[2] + "&")
    assert max(tries.values()) >= 3, tries  # a part was retried, not given up on at once
    assert pending(s3_client, bucket) == []
    assert objects(s3_client, bucket, "out/") == before  # no claim, no stage, the old files byte-identical
    result = CliRunner().invoke(main, reshard_over(ckpt, out, "-S", "skip_instance_cache=true"))
    assert result.exit_code == 0, result.output  # no `zeroshard clean` needed
    assert CliRunner().invoke(main, ["verify", "-q", out, "-S", "skip_instance_cache=true"]).exit_code == 0
    assert pending(s3_client, bucket) == []


@pytest.mark.slow
@pytest.mark.exclusive
def test_network_gone_mid_upload_fails_within_the_budget_and_says_what_is_left(proxy, old_output, s3_client):
    """From the first part on, every connection dies: nothing can be cleaned up remotely. The run
    (a process of its own, so that its claim's owner is gone after it) fails within the budget
    with one line saying an upload may be pending and how to remove it; clean then does."""
    ckpt, out, bucket, before = old_output
    down = []

    def rule(method, path, query):
        if method == "PUT" and "partNumber=" in query:
            down.append(True)
        return ("drop", 100) if down else None

    proxy.rule = rule
    result = subprocess.run([sys.executable, "-m", "zeroshard.cli", *reshard_over(ckpt, out, *via(proxy, BUDGET_S))],
                            capture_output=True, text=True, timeout=120, env=os.environ)
    took = time.monotonic() - proxy.faulted_at[0]
    assert result.returncode == 1 and result.stdout == "", result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"zeroshard_retry_s={BUDGET_S:g}" in lines[0] and "may be left pending" in lines[0], lines[0]
    assert f"zeroshard clean {out} --older-than 0s --yes" in lines[0], lines[0]
    assert BUDGET_S <= took < BUDGET_S + SLACK_S, took
    assert pending(s3_client, bucket), "the fault should have left the upload pending"
    assert "out/.zeroshard-claim" in objects(s3_client, bucket, "out/")

    cleaned = CliRunner().invoke(main, ["clean", out, "--older-than", "0s", "--yes"])
    assert cleaned.exit_code == 0 and "removed multipart upload" in cleaned.output, cleaned.output
    assert pending(s3_client, bucket) == []
    assert objects(s3_client, bucket, "out/") == before


@pytest.mark.slow
@pytest.mark.exclusive
def test_a_server_that_never_answers_is_given_up_on_within_the_budget(proxy, old_output, s3_client):
    """Part uploads are received but never answered: each attempt ends at the read timeout (no
    longer than the budget) or at the budget's end, never at the network's own minutes-long limits."""
    ckpt, out, bucket, before = old_output
    proxy.rule = lambda m, p, q: ("hang", 0) if m == "PUT" and "partNumber=" in q else None
    result = CliRunner().invoke(main, reshard_over(ckpt, out, *via(proxy, BUDGET_S)))
    took = time.monotonic() - proxy.faulted_at[0]
    one_line_failure(result, out, f"zeroshard_retry_s={BUDGET_S:g}")
    assert took < 2 * BUDGET_S + SLACK_S, took  # the first attempt's read timeout, then the budget
    assert pending(s3_client, bucket) == []
    assert objects(s3_client, bucket, "out/") == before


def test_a_fault_that_passes_within_the_budget_is_retried_and_the_output_commits(proxy, old_output, s3_client):
    ckpt, out, bucket, before = old_output
    faults = []

    def rule(method, path, query):
        if method == "PUT" and "partNumber=" in query and len(faults) < 4:
            faults.append(path)
            return ("drop", 100)
        return None

    proxy.rule = rule
    stream = random.getstate()
    result = CliRunner().invoke(main, reshard_over(ckpt, out, *via(proxy, 10.0)))
    assert result.exit_code == 0, result.output
    assert len(faults) == 4  # the faults did happen, and were retried past
    # the retries' jitter has its own generator: a training's `random` stream (saved in its
    # checkpoints, restored on resume) is not moved by them
    assert random.getstate() == stream
    assert pending(s3_client, bucket) == []
    keys = objects(s3_client, bucket, "out/")
    assert sorted(keys) == ["out/rank-00000-of-00003.safetensors", "out/rank-00001-of-00003.safetensors",
                            "out/rank-00002-of-00003.safetensors", "out/zeroshard.json"]  # no claim left
    assert keys != before
    assert CliRunner().invoke(main, ["verify", "-q", out, "-S", "skip_instance_cache=true"]).exit_code == 0


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "1e9"])
def test_a_bad_retry_budget_is_one_line_naming_the_option(tmp_path, value):
    ckpt = tmp_path / "ckpt"
    specs, data = training_state()
    write_checkpoint(str(ckpt), specs, data, 2)
    result = CliRunner().invoke(main, ["reshard", "-q", str(ckpt), "--to", "3", "-o", str(tmp_path / "o"),
                                       "-S", f"zeroshard_retry_s={value}"])
    one_line_failure(result, "storage option zeroshard_retry_s=", "expected seconds")


def test_retry_budget_values():
    from zeroshard.storage.remote_io import RemoteIO, split_options

    assert split_options({"zeroshard_retry_s": "2.5s"}) == (RemoteIO(retry_s=2.5), {})
    assert split_options({"zeroshard_retry_s": 90, "anon": True}) == (RemoteIO(retry_s=90.0), {"anon": True})
    assert split_options({})[0].retry_s == 60.0


@pytest.mark.slow
def test_a_claim_whose_answer_was_lost_is_still_ours(proxy, old_output, s3_client):
    """The claim's conditional PUT lands but its answer is lost: the retry is refused (the claim
    exists), and the claim found there is recognised as this run's own, not another writer's."""
    ckpt, out, bucket, before = old_output
    lost = []

    def rule(method, path, query):
        if method == "PUT" and path.endswith("/out/.zeroshard-claim") and not lost:
            lost.append(path)
            return ("lose_answer", 0)
        return None

    proxy.rule = rule
    result = CliRunner().invoke(main, reshard_over(ckpt, out, *via(proxy, 5.0)))
    assert result.exit_code == 0, result.output
    assert lost and sum(1 for r in proxy.requests if r[0] == "PUT" and r[1] in lost) >= 2  # it was retried
    assert "out/.zeroshard-claim" not in objects(s3_client, bucket, "out/")


@pytest.mark.slow
def test_a_failed_fresh_output_leaves_no_files_behind(proxy, old_output, s3_client):
    """A new S3 output is written in place (no stage to drop): when one rank file's upload fails,
    the rank files that did complete are removed with the claim, rather than left without a
    manifest until `zeroshard clean`."""
    ckpt, _, bucket, _ = old_output
    fresh = f"s3://{bucket}/fresh"
    proxy.rule = lambda m, p, q: ("drop", 100) if m == "PUT" and "rank-00002" in p else None
    result = CliRunner().invoke(main, ["reshard", "-q", str(ckpt), "--to", "3", "-o", fresh, *via(proxy, 1.0)])
    one_line_failure(result, fresh)
    assert any("rank-00000" in r[1] for r in proxy.requests if r[0] == "PUT"), "no other rank file was written"
    assert objects(s3_client, bucket, "fresh/") == {}
    assert pending(s3_client, bucket) == []
