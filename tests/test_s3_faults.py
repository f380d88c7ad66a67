"""S3 faults, injected by a proxy in front of moto (s3_fault_proxy): a dropped upload, a failing
read, a failing commit. In each: no half-written object becomes visible, the old output keeps
every byte until the new one commits, and `zeroshard clean` removes what the fault left."""

from __future__ import annotations

import hashlib

import pytest
from click.testing import CliRunner

from zeroshard.cli import main

from checkpoints import training_state, write_checkpoint
from s3_fault_proxy import FaultProxy

pytestmark = pytest.mark.s3


@pytest.fixture
def proxy(s3_endpoint, monkeypatch):
    import s3fs

    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # a fault is final: no waiting on retries
    p = FaultProxy(s3_endpoint)
    yield p
    p.close()


def via(proxy: FaultProxy) -> list[str]:
    return ["-S", f"endpoint_url={proxy.url}", "-S", "skip_instance_cache=true", "-S", "zeroshard_part_size=5MiB",
            "-S", 'config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}}']


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
