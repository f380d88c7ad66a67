"""Every toolkit command on S3 (issue 20): local -> S3, S3 -> local and S3 -> S3 where a command
has an input and an output, on S3 where it has one place. Commands covered elsewhere: reshard
and consolidate (test_s3.py, test_consolidate_filters.py, test_s3_torchrun.py for the torchrun
mode), shard local -> S3 (test_s3.py), clean (test_clean.py, test_s3_faults.py), ls and
load_state_dict (test_first_hour.py). Here: shard from S3, inspect, diff, sign, verify --key-file,
import dcp local -> S3, export dcp S3 -> local."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import zeroshard
from zeroshard.cli import main
from zeroshard.storage import Location

from checkpoints import odd_model, read_checkpoint, save_model, training_state, write_checkpoint
from test_roundtrip import assert_same

TIER = "default"  # docs/TESTING.md

pytestmark = pytest.mark.s3


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def test_shard_from_s3_to_local_and_to_s3(tmp_path, s3_bucket):
    model = odd_model()
    save_model(model, tmp_path / "m.safetensors")
    Location(f"{s3_bucket}/models").write_bytes("m.safetensors", (tmp_path / "m.safetensors").read_bytes())
    src = f"{s3_bucket}/models/m.safetensors"
    assert cli("shard", "-q", src, str(tmp_path / "w3"), "--world", "3")[0] == 0      # S3 -> local
    assert cli("shard", "-q", src, f"{s3_bucket}/w2", "--world", "2")[0] == 0         # S3 -> S3
    for ckpt in (str(tmp_path / "w3"), f"{s3_bucket}/w2"):
        assert cli("verify", "-q", ckpt)[0] == 0
        out = tmp_path / f"{ckpt.rsplit('/', 1)[-1]}.safetensors"
        assert cli("consolidate", "-q", ckpt, str(out))[0] == 0
        assert_same(model, load_file(out))


def test_inspect_diff_sign_and_verify_with_a_key_on_s3(tmp_path, s3_bucket, s3_client):
    specs, data = training_state()
    write_checkpoint(f"{s3_bucket}/c", specs, data, 2)
    write_checkpoint(str(tmp_path / "c3"), specs, data, 3)
    code, out = cli("inspect", f"{s3_bucket}/c", "--json")
    assert code == 0 and json.loads(out)["world_size"] == 2
    assert cli("diff", f"{s3_bucket}/c", str(tmp_path / "c3"), "--all")[0] == 0  # same values, other world size
    changed = dict(data, **{"embed.weight": data["embed.weight"] + 1})
    write_checkpoint(f"{s3_bucket}/d", specs, changed, 2)
    code, out = cli("diff", f"{s3_bucket}/c", f"{s3_bucket}/d")                 # S3 against S3
    assert code == 3 and "embed.weight" in out
    (tmp_path / "key").write_bytes(b"k" * 32)
    assert cli("sign", "-q", f"{s3_bucket}/c", "--key-file", str(tmp_path / "key"))[0] == 0
    assert Location(f"{s3_bucket}/c").exists("zeroshard.json.sig")
    code, out = cli("verify", f"{s3_bucket}/c", "--key-file", str(tmp_path / "key"))
    assert code == 0 and "signature holds" in out
    (tmp_path / "other").write_bytes(b"o" * 32)
    assert cli("verify", "-q", f"{s3_bucket}/c", "--key-file", str(tmp_path / "other"))[0] == 3


def test_import_dcp_to_s3_and_export_from_s3(tmp_path, s3_bucket):
    import torch.distributed.checkpoint as dcp

    model = {k: v for k, v in odd_model().items() if v.dtype == torch.float32 and v.dim() > 0}  # params are fp32
    dcp.save({"model": dict(model)}, checkpoint_id=str(tmp_path / "dcp"))  # one process, no group
    code, out = cli("import", "dcp", str(tmp_path / "dcp"), f"{s3_bucket}/imp", "--world", "2")  # local -> S3
    assert code == 0, out
    assert cli("verify", "-q", f"{s3_bucket}/imp")[0] == 0
    assert_same(model, zeroshard.load_state_dict(f"{s3_bucket}/imp"))
    code, out = cli("export", "dcp", f"{s3_bucket}/imp", str(tmp_path / "back"))                # S3 -> local
    assert code == 0, out
    loaded = {"model": {k: torch.empty_like(v) for k, v in model.items()}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "back"))
    assert_same(model, loaded["model"])
    assert_same(model, {k: v for k, v in read_checkpoint(f"{s3_bucket}/imp").items() if k in model})
