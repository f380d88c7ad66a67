"""`zeroshard clean`: lists, then removes, leftovers of dead writers; never a live writer's,
never an interrupted swap's stage, never a committed checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.storage.claim import CLAIM_NAME
from zeroshard.storage.leftovers import SWAP_MARKER
from zeroshard.storage.owner import host_id, owner_tag

from checkpoints import training_state, write_checkpoint

TIER = "mixed"  # docs/TESTING.md


def dead_owner() -> str:
    pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    return f"{host_id()}.{int(pid)}"


def age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def clean(*args):
    result = CliRunner().invoke(main, ["clean", *map(str, args)])
    assert "Traceback" not in result.output
    return result


def test_clean_lists_then_removes_only_stale_leftovers(tmp_path):
    specs, data = training_state()
    ckpt = tmp_path / "run" / "step-7"
    write_checkpoint(str(ckpt), specs, data, 2)
    committed = sorted(p.name for p in ckpt.iterdir())
    dead_temp = ckpt / f".zeroshard-tmp-{dead_owner()}-abcd1234-rank-00000-of-00002.safetensors"
    dead_temp.write_bytes(b"x" * 1000)
    live_temp = ckpt / f".zeroshard-tmp-{owner_tag()}-abcd1234-model.safetensors"  # this process: alive
    live_temp.write_bytes(b"y")
    age(live_temp, 86400)
    unknown_young = tmp_path / "run" / ".zeroshard-tmp-ffffffff.1-abcd1234-x"  # another host, fresh
    unknown_young.write_bytes(b"z")
    unknown_old = tmp_path / ".zeroshard-tmp-0123abcd-old-format"  # no owner tag: judged by age
    unknown_old.write_bytes(b"w")
    age(unknown_old, 7200)
    stage = tmp_path / "run" / f".zeroshard-tmp-{dead_owner()}-abcd1234-stage"
    stage.mkdir()
    (stage / "rank-00000-of-00001.safetensors").write_bytes(b"s" * 500)
    interrupted = tmp_path / "out" / f".zeroshard-tmp-{dead_owner()}-ef012345-stage"
    interrupted.mkdir(parents=True)
    (interrupted / "zeroshard.json").write_text("{}")
    (interrupted / SWAP_MARKER).write_text("swap")
    claim = tmp_path / "out" / CLAIM_NAME
    claim.write_text(json.dumps({"owner": dead_owner(), "time": time.time(), "nonce": "n"}))

    result = clean(tmp_path)  # default: a dry run
    assert result.exit_code == 0, result.output
    stale = {line.split(": ", 1)[1].split(" (")[0] for line in result.output.splitlines() if line.startswith("stale")}
    assert stale == {str(p) for p in (dead_temp, unknown_old, stage, claim)}, result.output
    assert "kept" in result.output and str(interrupted) in result.output and "interrupted" in result.output
    assert "--yes" in result.output
    assert dead_temp.exists() and stage.exists() and claim.exists()  # nothing removed yet

    result = clean(tmp_path, "--yes")
    assert result.exit_code == 0, result.output
    for gone in (dead_temp, unknown_old, stage, claim):
        assert not gone.exists(), gone
    for kept in (live_temp, unknown_young, interrupted):
        assert kept.exists(), kept
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == committed
    assert CliRunner().invoke(main, ["verify", "-q", str(ckpt)]).exit_code == 0

    result = clean(tmp_path, "--older-than", "0s", "--yes")  # a fresh leftover of another host, once asked
    assert not unknown_young.exists() and live_temp.exists() and interrupted.exists()


def test_clean_never_follows_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / f".zeroshard-tmp-{dead_owner()}-abcd1234-x"
    victim.write_bytes(b"precious")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(outside)
    result = clean(tmp_path / "root", "--yes")
    assert result.exit_code == 0 and "nothing to clean" in result.output
    assert victim.read_bytes() == b"precious"


def test_clean_errors_are_one_line(tmp_path):
    result = clean(tmp_path, "--older-than", "soon")
    assert result.exit_code == 1 and "cannot read age 'soon'" in result.output
    assert len(result.output.strip().splitlines()) == 1
    result = clean(tmp_path / "nothing-here")  # a typo'd path is an error, not "nothing to clean" (issue 19)
    assert result.exit_code == 1 and "nothing-here: no such folder" in result.output


# ---- every command's leftovers, after a SIGKILL mid-write (issue 17) ------------------------
KILLED_AT_A_RENAME = (
    "import os, signal, sys\n"
    "kill_at, renames, real = int(os.environ['KILL_AT']), [0], os.replace\n"
    "def replace(*args, **kwargs):\n"
    "    renames[0] += 1\n"
    "    if renames[0] == kill_at:\n"
    "        os.kill(os.getpid(), signal.SIGKILL)  # before this rename: files written, some in place\n"
    "    return real(*args, **kwargs)\n"
    "os.replace = replace\n"
    "from zeroshard.cli import main\n"
    "sys.argv = ['zeroshard'] + sys.argv[1:]\n"
    "main()\n")


def _sources(tmp_path):
    from safetensors.torch import save_file
    from test_safety_interop import ds_copy, save_dcp, zs_ckpt

    ck = zs_ckpt(tmp_path)
    model = tmp_path / "m.safetensors"
    save_file({f"w{i}": torch.randn(40 + i) for i in range(6)}, str(model))
    return {"ck": ck, "model": model, "ds": ds_copy(tmp_path), "dcp": save_dcp(tmp_path / "dcp_src")}


COMMANDS = {  # name: (arguments with {ck}, {model}, {ds}, {dcp}, {out}; the rename to die at)
    "reshard": ("reshard {ck} --to 3 -o {out}", 2),
    "consolidate-hf": ("consolidate {ck} {out} --max-shard-size 200B", 2),
    "consolidate-file": ("consolidate {ck} {out}/m.safetensors", 1),
    "shard": ("shard {model} {out} --world 3", 2),
    "import-deepspeed": ("import deepspeed {ds} {out} --world 2", 2),
    "import-dcp": ("import dcp {dcp} {out} --world 2", 2),
    "export-dcp": ("export dcp {ck} {out}", 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_clean_removes_what_any_killed_command_left(tmp_path, command, existing):
    """SIGKILL half-way through writing: what is left is leftovers only, and `zeroshard clean`
    (default age: the dead owner is on this host) brings the output back to what it was."""
    from test_safety_interop import snapshot

    sources = _sources(tmp_path)
    inputs = {name: snapshot(path) if path.is_dir() else path.read_bytes() for name, path in sources.items()}
    template, kill_at = COMMANDS[command]
    out = tmp_path / "out"
    args = template.format(out=out, **sources).split()
    if existing:
        result = subprocess.run([sys.executable, "-m", "zeroshard.cli", *args, "-q"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stderr
    before = snapshot(out) if existing else {}
    result = subprocess.run([sys.executable, "-c", KILLED_AT_A_RENAME, *args, "-q", "--overwrite"],
                            capture_output=True, text=True, timeout=120, env=dict(os.environ, KILL_AT=str(kill_at)))
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    result = clean(tmp_path, "--yes")
    assert result.exit_code == 0 and "removed" in result.output, result.output
    after = snapshot(out) if out.exists() else {}
    assert {k: v for k, v in after.items() if v != "folder"} == {k: v for k, v in before.items() if v != "folder"}
    assert not [p for p in tmp_path.rglob(".zeroshard-*")]
    assert inputs == {name: snapshot(path) if path.is_dir() else path.read_bytes() for name, path in sources.items()}


def _dead_claim(folder) -> None:
    (folder / CLAIM_NAME).write_text(json.dumps({"owner": dead_owner(), "time": time.time(), "nonce": "n"}))


def test_clean_finds_output_files_written_in_place_by_a_dead_writer(tmp_path):
    """An older zeroshard (or an S3 output) wrote straight into an empty folder and died before
    its commit file: the claim beside the files tells they are its, and nothing vouches for them."""
    names = ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "model-00001-of-00002.safetensors"]
    cases = {}
    for case in ("dead", "committed", "swapping", "live", "single"):
        folder = tmp_path / case
        folder.mkdir()
        for name in (names if case != "single" else ["model.safetensors"]):
            (folder / name).write_bytes(b"x" * 10)
        (folder / "notes.txt").write_text("mine")
        cases[case] = folder
        if case == "live":
            (folder / CLAIM_NAME).write_text(json.dumps({"owner": owner_tag(), "time": time.time(), "nonce": "n"}))
        else:
            _dead_claim(folder)
    (cases["committed"] / "zeroshard.json").write_text("{}")
    stage = cases["swapping"] / f".zeroshard-tmp-{dead_owner()}-abcd1234-stage"
    stage.mkdir()
    (stage / SWAP_MARKER).write_text("swap")
    (stage / "zeroshard.json").write_text("{}")

    result = clean(tmp_path)
    assert result.exit_code == 0, result.output
    assert "uncommitted file" in result.output and str(cases["dead"] / names[0]) in result.output
    result = clean(tmp_path, "--yes")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in cases["dead"].iterdir()) == ["notes.txt"]  # files and claim gone
    for case in ("committed", "swapping", "live"):
        assert all((cases[case] / name).exists() for name in names), case
    assert (cases["single"] / "model.safetensors").exists()  # no commit file exists for it: never taken


def test_clean_finds_uncommitted_output_files_on_s3(s3_bucket):
    import s3fs

    fs = s3fs.S3FileSystem()
    bucket = s3_bucket[len("s3://"):]
    claim = json.dumps({"owner": dead_owner(), "time": time.time(), "nonce": "n"}).encode()
    for folder in ("dead", "committed"):
        fs.pipe_file(f"{bucket}/{folder}/rank-00000-of-00001.safetensors", b"x" * 10)
        fs.pipe_file(f"{bucket}/{folder}/{CLAIM_NAME}", claim)
    fs.pipe_file(f"{bucket}/committed/zeroshard.json", b"{}")
    result = clean(s3_bucket, "--yes")
    assert result.exit_code == 0, result.output
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/dead/rank-00000-of-00001.safetensors")
    assert not fs.exists(f"{bucket}/dead/{CLAIM_NAME}")
    assert fs.exists(f"{bucket}/committed/rank-00000-of-00001.safetensors")
    assert fs.exists(f"{bucket}/committed/zeroshard.json")
