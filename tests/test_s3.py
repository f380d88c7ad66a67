"""The same round trips and failures over a real HTTP S3 endpoint (moto's server, see conftest)."""

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from zeroshard.cli import main
from zeroshard.storage import Location
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.shard import shard
from zeroshard.toolkit.verify import verify

from checkpoints import odd_model, read_checkpoint, save_model, training_state, write_checkpoint
from test_roundtrip import assert_same

TIER = "default"  # docs/TESTING.md

pytestmark = pytest.mark.s3


def test_shard_reshard_consolidate_all_on_s3(tmp_path, s3_bucket):
    model = odd_model()
    save_model(model, tmp_path / "m.safetensors")
    shard(str(tmp_path / "m.safetensors"), f"{s3_bucket}/run/w4", 4)          # local -> S3
    assert verify(f"{s3_bucket}/run/w4").ok
    reshard(f"{s3_bucket}/run/w4", 3, f"{s3_bucket}/run/w3")                   # S3 -> S3
    consolidate(f"{s3_bucket}/run/w3", f"{s3_bucket}/export/model.safetensors")  # S3 -> S3
    consolidate(f"{s3_bucket}/run/w3", str(tmp_path / "out.safetensors"))      # S3 -> local
    assert_same(model, load_file(tmp_path / "out.safetensors"))
    data = Location(f"{s3_bucket}/export").read_bytes("model.safetensors")
    assert data == (tmp_path / "out.safetensors").read_bytes()


@pytest.mark.parametrize("middle", [2, 5])
def test_reshard_round_trip_with_optimizer_state_on_s3(tmp_path, s3_bucket, middle):
    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/w4", specs, data, 4)
    reshard(f"{s3_bucket}/w4", middle, str(tmp_path / "mid"))                  # S3 -> local
    reshard(str(tmp_path / "mid"), 4, f"{s3_bucket}/back")                     # local -> S3
    original = {k: v for k, v in read_checkpoint(f"{s3_bucket}/w4").items() if not k.startswith("rng/")}
    assert_same(original, read_checkpoint(f"{s3_bucket}/back"))
    assert verify(f"{s3_bucket}/back").ok


def test_consolidate_reads_only_the_weights(s3_bucket):
    """Ranged reads: optimizer state (2/3 of the bytes here) is never fetched."""
    from zeroshard.format import CheckpointReader, open_checkpoint

    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/c", specs, data, 2)
    location, manifest = open_checkpoint(f"{s3_bucket}/c")
    weights = [t for t in manifest.tensors.values() if t.role in ("param", "buffer")]
    with CheckpointReader(location, manifest) as reader:
        for t in weights:
            reader.read_flat(t)
        assert reader.bytes_read == sum(t.nbytes for t in weights)
    assert reader.bytes_read < sum(f.size for f in manifest.files) / 2


def test_opening_a_checkpoint_asks_s3_twice(s3_bucket, s3_endpoint, s3_client):
    """Every command and load opens the manifest: one HEAD (is it a checkpoint?) and one ranged
    GET, not two more HEADs for its size. An empty manifest object is malformed JSON, said so."""
    from zeroshard.errors import CheckpointError
    from zeroshard.format import open_checkpoint

    from s3_fault_proxy import FaultProxy

    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/c", specs, data, 2)
    proxy = FaultProxy(s3_endpoint)
    try:
        options = {"endpoint_url": proxy.url, "skip_instance_cache": True}
        _, manifest = open_checkpoint(f"{s3_bucket}/c", options)
        assert manifest.world_size == 2
        asked = [(method, path) for method, path, *_ in proxy.requests if path.endswith("zeroshard.json")]
        assert sorted(method for method, _ in asked) == ["GET", "HEAD"], proxy.requests
        s3_client.put_object(Bucket=s3_bucket[len("s3://"):], Key="empty/zeroshard.json", Body=b"")
        with pytest.raises(CheckpointError, match="empty/zeroshard.json: manifest is not valid JSON"):
            open_checkpoint(f"{s3_bucket}/empty", options)
        # the store's door reads as a file does: a range past the end holds no bytes (S3 says 416)
        assert Location(f"{s3_bucket}/c").read_bytes("zeroshard.json", 10**9, 10**9 + 8) == b""
    finally:
        proxy.close()


@pytest.mark.parametrize("command", [["consolidate", "{src}", "{bucket}/out.safetensors"],
                                     ["reshard", "{src}", "--to", "3", "-o", "{bucket}/w3"],
                                     ["consolidate", "{src}", "{bucket}/x.safetensors", "--dry-run"],
                                     ["inspect", "{src}", "--tensors"]])
def test_a_command_reads_its_input_manifest_once(s3_bucket, s3_endpoint, command):
    """The command line opens its input once and hands it to the command: its checks (reshard's
    empty-rank check), the command and its closing line ("from ... (step N, world W)"), or
    inspect's summary and tensor list, read one manifest, with one GET (each open before was a
    HEAD and a GET more)."""
    from s3_fault_proxy import FaultProxy

    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/c", specs, data, 2)
    proxy = FaultProxy(s3_endpoint)
    try:
        args = [a.format(src=f"{s3_bucket}/c", bucket=s3_bucket) for a in command]
        result = CliRunner().invoke(main, [*args, "-q", "-S", f"endpoint_url={proxy.url}",
                                           "-S", "skip_instance_cache=true"])
        assert result.exit_code == 0, result.output
        asked = [(method, path) for method, path, *_ in proxy.requests if path.endswith("/c/zeroshard.json")]
        assert sorted(method for method, _ in asked) == ["GET", "HEAD"], asked
    finally:
        proxy.close()
    if command[0] == "consolidate" and "--dry-run" not in command:
        assert "world 2)" in result.output  # the closing line names the checkpoint it read


def test_bad_input_on_s3(s3_bucket, s3_client):
    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/c", specs, data, 2)
    bucket = s3_bucket[len("s3://"):]
    key = "c/rank-00001-of-00002.safetensors"
    body = bytearray(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    runner = CliRunner()
    result = runner.invoke(main, ["verify", "-q", f"{s3_bucket}/c"])
    assert result.exit_code == 3 and "rank-00001-of-00002.safetensors" in result.output
    s3_client.delete_object(Bucket=bucket, Key=key)
    result = runner.invoke(main, ["consolidate", "-q", f"{s3_bucket}/c", f"{s3_bucket}/o.safetensors"])
    assert result.exit_code == 1 and "rank-00001-of-00002.safetensors" in result.output
    assert "Traceback" not in result.output
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket, Prefix="o.safetensors")
    result = runner.invoke(main, ["inspect", "s3://no-such-bucket-zs/x"])
    assert result.exit_code == 1 and "s3://no-such-bucket-zs/x" in result.output and "Traceback" not in result.output


def test_failed_upload_leaves_no_object_and_no_pending_parts(s3_bucket, s3_client):
    """An upload that fails half-way (after 2 multipart parts) is aborted: nothing appears."""
    location = Location(s3_bucket)
    with pytest.raises(RuntimeError):
        with location.atomic_writer("big.bin") as out:
            out.write(b"x" * (12 * 1024 * 1024))  # s3fs uploads 5 MiB+ parts as the buffer fills
            raise RuntimeError("simulated failure mid-upload")
    bucket = s3_bucket[len("s3://"):]
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket)
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    with location.atomic_writer("ok.bin") as out:
        out.write(b"y" * 10)
    assert location.read_bytes("ok.bin") == b"y" * 10


def test_storage_options_on_the_command_line(tmp_path, s3_bucket, s3_endpoint, monkeypatch):
    save_model({"w": torch.arange(6.0)}, tmp_path / "m.safetensors")
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    result = CliRunner().invoke(main, ["shard", "-q", str(tmp_path / "m.safetensors"), f"{s3_bucket}/x", "--world", "2",
                                       "-S", f"endpoint_url={s3_endpoint}", "-S", "skip_instance_cache=true"])
    assert result.exit_code == 0, result.output
