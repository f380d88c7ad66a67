"""`zeroshard sign` / `verify --key-file`: what a signature catches that XXH3 hashes cannot."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.format.signature import SIGNATURE_NAME
from zeroshard.toolkit.verify import verify

from checkpoints import training_state, write_checkpoint

TIER = "default"  # docs/TESTING.md

RANK1 = "rank-00001-of-00002.safetensors"


def cli(*args):
    result = CliRunner().invoke(main, list(map(str, args)))
    assert "Traceback" not in result.output, result.output
    return result


@pytest.fixture
def signed(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ckpt"), specs, data, 2)
    (tmp_path / "key").write_text("0123456789abcdef0123456789abcdef\n")
    result = cli("sign", "-q", tmp_path / "ckpt", "--key-file", tmp_path / "key")
    assert result.exit_code == 0 and SIGNATURE_NAME in result.output, result.output
    return tmp_path / "ckpt", tmp_path / "key"


def test_signed_checkpoint_verifies_with_its_key(signed):
    ckpt, key = signed
    result = cli("verify", "-q", ckpt, "--key-file", key)
    assert result.exit_code == 0 and "signature holds" in result.output, result.output
    assert cli("verify", "-q", ckpt).exit_code == 0  # the signature file is no stray file to a plain verify


def test_a_forged_checkpoint_with_consistent_hashes_is_caught(signed, tmp_path):
    """The threat plain hashes cannot meet: NaN weights written as a fresh, self-consistent
    checkpoint (every XXH3 recomputed) over the signed one, the old signature left in place."""
    ckpt, key = signed
    specs, data = training_state()
    forged = {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in data.items()}
    write_checkpoint(str(tmp_path / "forged"), specs, forged, 2)
    for p in (tmp_path / "forged").iterdir():
        shutil.copy(p, ckpt / p.name)
    assert cli("verify", "-q", ckpt).exit_code == 0  # hashes alone are satisfied
    result = cli("verify", "-q", ckpt, "--key-file", key)
    assert result.exit_code == 3 and "manifest was changed after it was signed" in result.output, result.output


def test_changed_file_bytes_are_caught_by_the_signed_sha256(signed):
    ckpt, key = signed
    data = bytearray((ckpt / RANK1).read_bytes())
    data[-3] ^= 0x01
    (ckpt / RANK1).write_bytes(bytes(data))
    report = verify(str(ckpt), key=(key.read_bytes().strip()))
    assert not report.ok and not report.signed
    assert any(RANK1 in p and "SHA-256 differs from the signed one" in p for p in report.problems), report.problems


def test_wrong_key_missing_or_altered_signature_fail(signed, tmp_path):
    ckpt, key = signed
    (tmp_path / "other").write_text("another key of enough bytes......")
    result = cli("verify", "-q", ckpt, "--key-file", tmp_path / "other")
    assert result.exit_code == 3 and "signed with another key" in result.output
    doc = json.loads((ckpt / SIGNATURE_NAME).read_text())
    doc["files_sha256"][RANK1] = "0" * 64
    (ckpt / SIGNATURE_NAME).write_text(json.dumps(doc))
    result = cli("verify", "-q", ckpt, "--key-file", key)
    assert result.exit_code == 3 and "signature file altered" in result.output
    (ckpt / SIGNATURE_NAME).write_text("[1, 2")
    result = cli("verify", "-q", ckpt, "--key-file", key)
    assert result.exit_code == 3 and "not a valid zeroshard signature file" in result.output
    (ckpt / SIGNATURE_NAME).unlink()
    result = cli("verify", "-q", ckpt, "--key-file", key)
    assert result.exit_code == 3 and SIGNATURE_NAME in result.output and "not signed" in result.output


def test_bad_keys_and_unverifiable_checkpoints_are_not_signed(signed, tmp_path):
    ckpt, key = signed
    (tmp_path / "short").write_text("tiny")
    result = cli("sign", "-q", ckpt, "--key-file", tmp_path / "short")
    assert result.exit_code == 1 and "use at least 16" in result.output and len(result.output.splitlines()) == 1
    result = cli("sign", "-q", ckpt, "--key-file", tmp_path / "missing")
    assert result.exit_code == 1 and "cannot read key file" in result.output
    (ckpt / SIGNATURE_NAME).unlink()
    data = bytearray((ckpt / RANK1).read_bytes())
    data[-3] ^= 0x01
    (ckpt / RANK1).write_bytes(bytes(data))
    result = cli("sign", "-q", ckpt, "--key-file", key)
    assert result.exit_code == 1 and "not signed: it does not verify" in result.output, result.output
    assert not (ckpt / SIGNATURE_NAME).exists()
