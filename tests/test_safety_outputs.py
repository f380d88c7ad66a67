"""Outputs never destroy inputs or old outputs: identity by resolved path, --overwrite that keeps
the old output until the new one commits, and no links followed out of a checkpoint."""

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroshard.cli import main

from checkpoints import save_model, training_state, write_checkpoint
from test_bad_input import _cli_with_file_size_limit

TIER = "default"  # docs/TESTING.md

RANK0 = "rank-00000-of-00003.safetensors"


def run_cli(*args):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def assert_one_line_error(code, output, *needles):
    assert code == 1, output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    for needle in needles:
        assert needle in output, output


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (hidden ones included), by relative path -> SHA-256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink()}


@pytest.fixture
def ckpt(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ckpt"), specs, data, 3)
    return tmp_path / "ckpt"


def corrupt_copy(ckpt: Path, dest: Path) -> Path:
    """A copy of `ckpt` whose last rank file has a flipped byte in its data: a reader finds out
    only half-way through, after it has written part of its output."""
    dest.mkdir()
    for p in ckpt.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    last = dest / "rank-00002-of-00003.safetensors"
    data = bytearray(last.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + length])["embed.weight"]["data_offsets"]  # a weight: every reader needs it
    data[8 + length + (begin + end) // 2] ^= 0xFF
    last.write_bytes(bytes(data))
    return dest


# ---- 1. output identity ----------------------------------------------------------------------
def _spellings(folder: Path):
    (folder.parent / "link").symlink_to(folder)
    return {
        "dot": str(folder) + "/.",
        "dotdot": str(folder / ".." / folder.name),
        "symlink": str(folder.parent / "link"),
        "inside": str(folder / "sub"),
        "parent": str(folder.parent),
    }


@pytest.mark.parametrize("spelling", ["dot", "dotdot", "symlink", "inside", "parent"])
@pytest.mark.parametrize("command", ["reshard", "consolidate", "shard"])
def test_output_that_is_the_input_under_another_name_is_refused(ckpt, spelling, command, tmp_path):
    if command == "shard":  # shard's input: a full model folder
        source = tmp_path / "hf"
        assert run_cli("consolidate", "-q", str(ckpt), str(source))[0] == 0
    else:
        source = ckpt
    out = _spellings(source)[spelling]
    before = snapshot(source)
    args = {"reshard": ["reshard", "-q", "--overwrite", str(ckpt), "--to", "3", "-o", out],
            "consolidate": ["consolidate", "-q", "--overwrite", str(ckpt), out],
            "shard": ["shard", "-q", "--overwrite", str(source), out, "--world", "2"]}[command]
    code, output = run_cli(*args)
    assert_one_line_error(code, output, "must differ from the input")
    assert snapshot(source) == before
    assert run_cli("verify", "-q", str(ckpt))[0] == 0


def test_shard_into_its_own_model_file_is_refused(tmp_path):
    save_model({"w": __import__("torch").arange(6.0)}, tmp_path / "m.safetensors")
    before = snapshot(tmp_path)
    code, output = run_cli("shard", "-q", "--overwrite", str(tmp_path / "m.safetensors"),
                           str(tmp_path / "m.safetensors"), "--world", "2")
    assert_one_line_error(code, output, "must differ from the input")
    assert snapshot(tmp_path) == before


def test_consolidate_into_a_rank_file_of_the_input_is_refused(ckpt):
    before = snapshot(ckpt)
    for out in (ckpt / RANK0, ckpt / "." / RANK0, ckpt.parent / "link.safetensors"):
        if out.name == "link.safetensors":
            out.symlink_to(ckpt / RANK0)
        code, output = run_cli("consolidate", "-q", "--overwrite", str(ckpt), str(out))
        assert_one_line_error(code, output, "is inside the input")
    assert snapshot(ckpt) == before


def test_output_inside_a_root_given_through_latest_is_refused(tmp_path):
    specs, data = training_state()
    root = tmp_path / "run"
    write_checkpoint(str(root / "step-7"), specs, data, 2)
    (root / "latest").write_text("step-7\n")
    code, output = run_cli("reshard", "-q", str(root), "--to", "2", "-o", str(root))
    assert_one_line_error(code, output, "must differ")
    assert run_cli("verify", "-q", str(root))[0] == 0


# ---- 2. --overwrite keeps the old output until the new one commits ----------------------------
def test_failed_reshard_overwrite_leaves_the_old_output_exactly_as_it_was(ckpt, tmp_path):
    out = tmp_path / "out"
    assert run_cli("reshard", "-q", str(ckpt), "--to", "3", "-o", str(out))[0] == 0
    before = snapshot(out)
    bad = corrupt_copy(ckpt, tmp_path / "bad")
    code, output = run_cli("reshard", "-q", "--overwrite", str(bad), "--to", "3", "-o", str(out))
    assert_one_line_error(code, output, "rank-00002-of-00003.safetensors", "hash")
    assert snapshot(out) == before  # not a byte changed, no leftover hidden files
    assert run_cli("verify", "-q", str(out))[0] == 0


def test_successful_overwrite_replaces_the_old_output_and_leaves_nothing_behind(ckpt, tmp_path):
    out = tmp_path / "out"
    assert run_cli("reshard", "-q", str(ckpt), "--to", "3", "-o", str(out))[0] == 0
    (out / "notes.txt").write_text("mine")
    code, output = run_cli("reshard", "-q", "--overwrite", str(ckpt), "--to", "2", "-o", str(out))
    assert code == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "rank-00000-of-00002.safetensors",
                                                     "rank-00001-of-00002.safetensors", "zeroshard.json"]
    assert run_cli("verify", "-q", str(out))[0] == 0


def test_failed_consolidate_overwrite_keeps_the_old_hf_export(ckpt, tmp_path):
    out = tmp_path / "hf"
    assert run_cli("consolidate", "-q", str(ckpt), str(out), "--max-shard-size", "2000B")[0] == 0
    (out / "config.json").write_text("{}")
    assert (out / "model.safetensors.index.json").exists()
    before = snapshot(out)
    bad = corrupt_copy(ckpt, tmp_path / "bad")
    code, output = run_cli("consolidate", "-q", "--overwrite", str(bad), str(out), "--max-shard-size", "1000B")
    assert_one_line_error(code, output, "bad/rank-")
    assert snapshot(out) == before
    code, output = run_cli("consolidate", "-q", "--overwrite", str(ckpt), str(out))  # now one file fits
    assert code == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_disk_full_half_way_through_an_overwrite_keeps_the_old_output(tmp_path):
    torch = pytest.importorskip("torch")
    save_model({f"w{i}": torch.randn(256, 256) for i in range(4)}, tmp_path / "m.safetensors")  # 1 MiB
    assert run_cli("shard", "-q", str(tmp_path / "m.safetensors"), str(tmp_path / "ckpt"), "--world", "2")[0] == 0
    out = tmp_path / "out"
    assert run_cli("reshard", "-q", str(tmp_path / "ckpt"), "--to", "3", "-o", str(out))[0] == 0
    before = snapshot(out)
    result = _cli_with_file_size_limit(300_000, "reshard", "-q", "--overwrite", str(tmp_path / "ckpt"), "--to", "3",
                                       "-o", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and str(out) in result.stderr
    assert snapshot(out) == before
    assert run_cli("verify", "-q", str(out))[0] == 0


# The CLI, SIGKILLed when it opens its second input file (the first one's data is copied).
KILLED_AFTER_ONE_INPUT = (  # inputs are opened by the reader, or (small ones) read whole by the store
    "import os, signal, sys\n"
    "from zeroshard.format import reader\n"
    "from zeroshard.storage import location\n"
    "seen = set()\n"
    "def dying(real):\n"
    "    def opening(self, which, *args):\n"
    "        seen.add(which)\n"
    "        if len(seen) > 1: os.kill(os.getpid(), signal.SIGKILL)\n"
    "        return real(self, which, *args)\n"
    "    return opening\n"
    "reader.CheckpointReader.open_file = dying(reader.CheckpointReader.open_file)\n"
    "location.Location.read_whole_into = dying(location.Location.read_whole_into)\n"
    "from zeroshard.cli import main\n"
    "sys.argv = ['zeroshard'] + sys.argv[1:]\n"
    "main()\n")


def test_a_killed_writer_leaves_old_output_intact_and_the_next_run_cleans_up(ckpt, tmp_path):
    """SIGKILL half-way through an overwrite: the old output still verifies; the hidden stage it
    left is removed by the next run into the same output (its owner is dead)."""
    out = tmp_path / "out"
    assert run_cli("reshard", "-q", str(ckpt), "--to", "2", "-o", str(out))[0] == 0
    before = snapshot(out)
    script = KILLED_AFTER_ONE_INPUT
    result = subprocess.run([sys.executable, "-c", script, "reshard", "-q", "--overwrite", str(ckpt), "--to", "2",
                             "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    hidden = [p.name for p in out.iterdir() if p.name.startswith(".zeroshard-")]
    assert hidden, "the killed writer should have left its stage and claim behind"
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(".zeroshard-")} == before
    assert run_cli("verify", "-q", str(out))[0] == 0
    code, output = run_cli("reshard", "-q", "--overwrite", str(ckpt), "--to", "2", "-o", str(out))
    assert code == 0, output
    assert not [p.name for p in out.iterdir() if p.name.startswith(".zeroshard-")]


# ---- 4. links --------------------------------------------------------------------------------
def test_a_rank_file_that_is_a_link_out_of_the_folder_is_refused(ckpt, tmp_path):
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes((ckpt / RANK0).read_bytes())  # the very same bytes: only the link is wrong
    (ckpt / RANK0).unlink()
    (ckpt / RANK0).symlink_to(elsewhere)
    code, output = run_cli("verify", "-q", str(ckpt))
    assert code == 3 and RANK0 in output and "symbolic link" in output, output
    code, output = run_cli("consolidate", "-q", str(ckpt), str(tmp_path / "o.safetensors"))
    assert_one_line_error(code, output, RANK0, "symbolic link")


def test_manifest_latest_and_checkpoint_folder_links_are_refused(ckpt, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-7").symlink_to(ckpt)
    (root / "latest").write_text("step-7\n")
    assert_one_line_error(*run_cli("inspect", str(root)), "step-7", "symbolic link")
    other = tmp_path / "other"
    other.mkdir()
    (other / "zeroshard.json").symlink_to(ckpt / "zeroshard.json")
    assert_one_line_error(*run_cli("inspect", str(other)), "zeroshard.json", "symbolic link")
    root2 = tmp_path / "root2"
    root2.mkdir()
    (tmp_path / "whatever").write_text("step-7\n")
    (root2 / "latest").symlink_to(tmp_path / "whatever")
    assert_one_line_error(*run_cli("inspect", str(root2)), "latest", "symbolic link")


# ---- 5. latest -------------------------------------------------------------------------------
def test_a_huge_latest_file_is_an_error_of_one_short_line(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "latest").write_bytes(b"A" * 10_000_000)
    code, output = run_cli("inspect", str(root))
    assert_one_line_error(code, output, "latest", "over 4096 bytes")
    assert len(output) < 400
    (root / "latest").write_bytes(b"../" + b"x" * 3000)
    code, output = run_cli("inspect", str(root))
    assert_one_line_error(code, output, "latest", "not a folder inside")
    assert len(output) < 400


def test_a_killed_consolidate_leaves_a_temp_that_the_next_run_removes(ckpt, tmp_path):
    script = KILLED_AFTER_ONE_INPUT
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the old export")
    result = subprocess.run([sys.executable, "-c", script, "consolidate", "-q", "--overwrite", str(ckpt),
                             str(out / "model.safetensors")], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    temps = [p for p in out.iterdir() if p.name.startswith(".zeroshard-tmp-")]
    assert len(temps) == 1 and (out / "model.safetensors").read_bytes() == b"the old export"
    code, output = run_cli("consolidate", "-q", "--overwrite", str(ckpt), str(out / "model.safetensors"))
    assert code == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_a_failure_inside_the_swap_keeps_the_whole_new_output_and_clean_spares_it(ckpt, tmp_path, monkeypatch):
    from zeroshard.errors import StorageError
    from zeroshard.storage.location import Location

    out = tmp_path / "out"
    assert run_cli("reshard", "-q", str(ckpt), "--to", "3", "-o", str(out))[0] == 0
    real = Location.write_bytes

    def failing(self, name, data):
        if name == "zeroshard.json" and self.path.rstrip("/") == str(out):
            raise StorageError(self.url_of(name), "no space left on device")  # the final commit write
        return real(self, name, data)

    monkeypatch.setattr(Location, "write_bytes", failing)
    code, output = run_cli("reshard", "-q", "--overwrite", str(ckpt), "--to", "2", "-o", str(out))
    assert_one_line_error(code, output, "out/zeroshard.json", "no space")
    monkeypatch.setattr(Location, "write_bytes", real)
    stages = [p for p in out.iterdir() if p.name.startswith(".zeroshard-tmp-")]
    assert len(stages) == 1 and (stages[0] / "zeroshard.json").exists()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    result = CliRunner().invoke(main, ["clean", str(tmp_path), "--older-than", "0s", "--yes"])
    assert "kept staging folder" in result.output and stages[0].exists(), result.output
    os.replace(stages[0] / "zeroshard.json", out / "zeroshard.json")  # the recovery docs/SAFETY.md gives
    assert run_cli("verify", "-q", str(out))[0] == 0
