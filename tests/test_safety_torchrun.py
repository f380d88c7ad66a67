"""The torchrun mode agrees before it writes (issue 17): processes started with different
arguments or reading different checkpoints all refuse, in one line naming the difference, and
nothing is created in the output; arguments that differ only in spelling are accepted."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from zeroshard.toolkit.verify import verify

from checkpoints import read_checkpoint, training_state, write_checkpoint
from distributed import free_port, run_ranks
from test_roundtrip import assert_same

TIER = "slow"  # docs/TESTING.md

# Each process takes, of every argument written "a|b", the alternative at its RANK.
WRAPPER = """
import os, sys
from zeroshard.cli import main
rank = int(os.environ["RANK"])
main([a.split("|")[rank] if "|" in a else a for a in sys.argv[1:]], prog_name="zeroshard")
"""


def torchrun_per_rank(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "per_rank.py"
    wrapper.write_text(WRAPPER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={free_port()}", str(wrapper), *args],
                          capture_output=True, text=True, timeout=240, env=env)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, hidden ones included, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """Each process's one-line error. Both processes write to the same pipe, and a run was seen with
    the two lines joined (no newline between them), so the text is cut at each error's start."""
    parts = re.split(r"(?=zeroshard: error)", result.stderr)
    return [part.splitlines()[0] for part in parts if part.startswith("zeroshard: error")]


def test_reshard_processes_with_different_targets_refuse_together(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 3)
    write_checkpoint(str(tmp_path / "old"), specs, data, 2)  # a previous output, to be kept as it is
    before = snapshot(tmp_path / "old")
    result = torchrun_per_rank(tmp_path, "reshard", str(tmp_path / "c"), "--to", "2|4", "-o", str(tmp_path / "old"),
                               "--overwrite")
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 2, result.stderr[-3000:]  # every process refuses, each in one line
    for line in lines:
        assert "process 1 was started with --to 4, process 0 with --to 2" in line, line
        assert "manifest" not in line  # the same checkpoint: only --to differs
    assert snapshot(tmp_path / "old") == before  # byte-identical, no claim, no stage
    assert verify(str(tmp_path / "old")).ok


def test_processes_reading_different_checkpoints_refuse(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "a"), specs, data, 2)
    write_checkpoint(str(tmp_path / "b"), specs, data, 2)  # same shapes, another checkpoint id
    result = torchrun_per_rank(tmp_path, "reshard", f"{tmp_path / 'a'}|{tmp_path / 'b'}", "--to", "3",
                               "-o", str(tmp_path / "out"), "-j", "1|2")
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 2, result.stderr[-3000:]
    assert "process 1 reads a different checkpoint (manifest id" in lines[0]
    assert "process 1 was started with -j 2, process 0 with -j 1" in lines[0]
    assert not (tmp_path / "out").exists()  # nothing created in the output location


def test_consolidate_with_another_dtype_refuses_and_keeps_the_old_file(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 2)
    old = tmp_path / "m.safetensors"
    old.write_bytes(b"previous output")
    result = torchrun_per_rank(tmp_path, "consolidate", str(tmp_path / "c"), str(old), "--dtype", "bf16|fp16",
                               "--overwrite")
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 2 and "process 1 was started with --dtype fp16, process 0 with --dtype bf16" in lines[0]
    assert old.read_bytes() == b"previous output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "m.safetensors", "per_rank.py"]


def test_the_same_arguments_spelled_differently_are_accepted(tmp_path):
    """A link to the checkpoint, a relative output path and 1KB vs 1000 bytes mean the same run."""
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 2)
    (tmp_path / "link").symlink_to(tmp_path / "c")
    result = torchrun_per_rank(tmp_path, "consolidate", f"{tmp_path / 'c'}|{tmp_path / 'link'}",
                               f"{tmp_path / 'hf'}|{os.path.relpath(tmp_path / 'hf')}", "--max-shard-size", "1KB|1000")
    assert result.returncode == 0, result.stderr[-3000:]
    full = read_checkpoint(str(tmp_path / "c"))
    merged = {k: v for f in (tmp_path / "hf").glob("model-*.safetensors") for k, v in load_file(f).items()}
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert_same({k: v for k, v in full.items() if not k.startswith(("optimizer/", "rng/"))}, merged)


# ---- an output path that is a file (issue 17) --------------------------------------------------
def test_an_output_that_is_a_file_is_one_line_naming_it(tmp_path):
    from click.testing import CliRunner

    from zeroshard.cli import main

    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 2)
    save_file({"w": torch.ones(3)}, str(tmp_path / "m.safetensors"))
    blocker = tmp_path / "file"
    blocker.write_bytes(b"precious")
    (tmp_path / "dir.safetensors").mkdir()
    cases = [(["reshard", "c", "--to", "3", "-o", "file"], "file: exists and is a file"),
             (["reshard", "c", "--to", "3", "-o", "file/sub"], f"{blocker}: exists and is a file"),
             (["consolidate", "c", "file"], "file: exists and is a file"),
             (["consolidate", "c", "file/m.safetensors"], "file: exists and is a file"),
             (["consolidate", "c", "dir.safetensors"], "dir.safetensors: exists and is a folder, not a file"),
             (["shard", "m.safetensors", "file", "--world", "2"], "file: exists and is a file"),
             (["export", "dcp", "c", "file"], "file: exists and is a file")]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for args, needle in cases:
            result = CliRunner().invoke(main, [*args, "--overwrite", "-q"])
            assert result.exit_code == 1, (args, result.output)
            assert len(result.output.strip().splitlines()) == 1 and needle in result.output, (args, result.output)
            assert "Errno" not in result.output
    finally:
        os.chdir(cwd)
    assert blocker.read_bytes() == b"precious" and not list((tmp_path / "dir.safetensors").iterdir())
    result = torchrun_per_rank(tmp_path, "reshard", str(tmp_path / "c"), "--to", "3", "-o", str(blocker))
    assert result.returncode != 0 and f"{blocker}: exists and is a file" in result.stderr, result.stderr[-2000:]
    assert "Errno" not in result.stderr and blocker.read_bytes() == b"precious"


def _consolidate_logging_durability(rank: int, world: int, ckpt: str, out: str) -> list[tuple[str, str]]:
    """consolidate_distributed, with this process's fsyncs and moves into place logged in order."""
    from zeroshard.storage.location import Location
    from zeroshard.toolkit import transfer
    from zeroshard.toolkit.distributed import consolidate_distributed

    events: list[tuple[str, str]] = []
    fsync, move = Location.fsync, transfer.move_into_place

    def logged_fsync(self, names):
        events.extend(("fsync", name) for name in names)
        return fsync(self, names)

    def logged_move(target, temp_path, name):
        events.append(("move", temp_path.rsplit("/", 1)[-1]))
        return move(target, temp_path, name)

    Location.fsync, transfer.move_into_place = logged_fsync, logged_move
    try:
        consolidate_distributed(ckpt, out)
    finally:  # the rank processes are pooled: later tests get the real calls back
        Location.fsync, transfer.move_into_place = fsync, move
    return events


def test_torchrun_consolidate_syncs_a_file_no_process_wrote_into_before_moving_it(tmp_path):
    """A model of empty tensors: process 0 creates the output (a header, no piece for anyone to
    write), and must make it durable before it appears under its name, as the single-process
    command does. Before the fix it was moved first and fsynced only after."""
    save_file({"a": torch.zeros(0), "b": torch.zeros(0, 3)}, str(tmp_path / "m.safetensors"))
    subprocess.run([sys.executable, "-m", "zeroshard.cli", "shard", str(tmp_path / "m.safetensors"),
                    str(tmp_path / "ck"), "--world", "2"], check=True, capture_output=True, timeout=120)
    out = tmp_path / "out.safetensors"
    events = run_ranks(_consolidate_logging_durability, 2, timeout=180, ckpt=str(tmp_path / "ck"), out=str(out))[0]
    moves = [i for i, (kind, _) in enumerate(events) if kind == "move"]
    assert moves, events
    for i in moves:
        assert ("fsync", events[i][1]) in events[:i], (events[i], events)
    assert load_file(str(out))["b"].shape == (0, 3)
