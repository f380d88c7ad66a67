"""The torchrun mode on S3 (issue 20): `torchrun ... -m zeroshard.toolkit reshard|consolidate`
local -> S3, S3 -> local and S3 -> S3 against moto's server (conftest), with the bytes the
single-process commands write, and a failure anywhere committing nothing."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from zeroshard.storage import Location
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.verify import verify

from checkpoints import read_checkpoint, training_state, write_checkpoint
from distributed import free_port
from test_bad_input import flip_byte_in
from test_roundtrip import assert_same

TIER = "slow"  # docs/TESTING.md

pytestmark = pytest.mark.s3


def torchrun(*args: str, nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(env or os.environ, OMP_NUM_THREADS="1")  # AWS_* point at moto (conftest's s3_endpoint)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           f"--master-port={free_port()}", "-m", "zeroshard.toolkit", *args],
                          capture_output=True, text=True, timeout=240, env=env)


def objects(bucket: str, client, prefix: str = "") -> list[str]:
    listed = client.list_objects_v2(Bucket=bucket[len("s3://"):], Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def weights(url: str) -> dict:
    return {k: v for k, v in read_checkpoint(url).items() if not k.startswith("rng/")}


def test_reshard_local_to_s3_to_s3_to_local(tmp_path, s3_bucket, s3_client, s3_endpoint):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "w4"), specs, data, 4)
    original = weights(str(tmp_path / "w4"))
    # S3 -> S3 finds the endpoint in -S only, as on the CLI
    no_endpoint = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    for src, to, out, extra in ((str(tmp_path / "w4"), "3", f"{s3_bucket}/w3", ()),  # local -> S3
                                (f"{s3_bucket}/w3", "5", f"{s3_bucket}/w5", ("-S", f"endpoint_url={s3_endpoint}")),
                                (f"{s3_bucket}/w5", "2", str(tmp_path / "w2"), ())):  # S3 -> local
        result = torchrun("reshard", src, "--to", to, "-o", out, *extra, env=no_endpoint if extra else None)
        assert result.returncode == 0, result.stderr[-3000:]
        assert verify(out).ok
        assert_same(original, weights(out))
    # each output rank file was written once, by one process; the manifest lists them all
    assert objects(s3_bucket, s3_client, "w5/") == [
        f"w5/rank-{r:05d}-of-00005.safetensors" for r in range(5)] + ["w5/zeroshard.json"]
    # the bytes a single process writes, but for the fresh checkpoint id in every header
    single = reshard(f"{s3_bucket}/w3", 5, str(tmp_path / "single5"))
    assert [f.size for f in single.manifest.files] == [
        Location(f"{s3_bucket}/w5").size(f"rank-{r:05d}-of-00005.safetensors") for r in range(5)]


def test_consolidate_to_and_from_s3_matches_a_single_process(tmp_path, s3_bucket, s3_client):
    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/c", specs, data, 3)
    write_checkpoint(str(tmp_path / "c"), specs, data, 3)
    consolidate(str(tmp_path / "c"), str(tmp_path / "ref.safetensors"))
    consolidate(str(tmp_path / "c"), str(tmp_path / "ref-hf"), max_shard_size="300B")
    reference = (tmp_path / "ref.safetensors").read_bytes()
    shards = sorted(p.name for p in (tmp_path / "ref-hf").iterdir())
    assert len([n for n in shards if n.startswith("model-")]) >= 3  # several files to deal out

    with ThreadPoolExecutor(3) as launches:  # independent outputs: side by side (CI time)
        to_s3, local_to_s3, to_local = [launches.submit(torchrun, "consolidate", *args) for args in (
            (f"{s3_bucket}/c", f"{s3_bucket}/hf", "--max-shard-size", "300B"),  # S3 -> S3
            (str(tmp_path / "c"), f"{s3_bucket}/one/model.safetensors"),  # local -> S3
            (f"{s3_bucket}/c", str(tmp_path / "back.safetensors"), "-j", "2"))]  # S3 -> local
    result = to_s3.result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert objects(s3_bucket, s3_client, "hf/") == [f"hf/{n}" for n in shards]
    remote = Location(f"{s3_bucket}/hf")
    for name in shards:
        assert remote.read_bytes(name) == (tmp_path / "ref-hf" / name).read_bytes(), name

    result = local_to_s3.result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert Location(f"{s3_bucket}/one").read_bytes("model.safetensors") == reference

    result = to_local.result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "back.safetensors").read_bytes() == reference


def test_overwrite_on_s3_and_a_failure_commits_nothing(tmp_path, s3_bucket, s3_client):
    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/c", specs, data, 4)
    write_checkpoint(str(tmp_path / "bad"), specs, data, 4)
    flip_byte_in(tmp_path / "bad" / "rank-00003-of-00004.safetensors", "embed.weight")
    assert torchrun("reshard", f"{s3_bucket}/c", "--to", "3", "-o", f"{s3_bucket}/out").returncode == 0
    before = {k: Location(s3_bucket).read_bytes(k) for k in objects(s3_bucket, s3_client, "out/")}

    result = torchrun("reshard", str(tmp_path / "bad"), "--to", "2", "-o", f"{s3_bucket}/out", "--overwrite")
    assert result.returncode == 1
    assert "rank-00003-of-00004.safetensors" in result.stderr and "hash mismatch" in result.stderr
    assert {k: Location(s3_bucket).read_bytes(k) for k in objects(s3_bucket, s3_client, "out/")} == before
    assert not s3_client.list_multipart_uploads(Bucket=s3_bucket[len("s3://"):]).get("Uploads")

    result = torchrun("reshard", f"{s3_bucket}/c", "--to", "2", "-o", f"{s3_bucket}/out", "--overwrite")
    assert result.returncode == 0, result.stderr[-3000:]
    assert objects(s3_bucket, s3_client, "out/") == ["out/rank-00000-of-00002.safetensors",
                                                     "out/rank-00001-of-00002.safetensors", "out/zeroshard.json"]
    assert verify(f"{s3_bucket}/out").ok
    assert_same(weights(f"{s3_bucket}/c"), weights(f"{s3_bucket}/out"))
