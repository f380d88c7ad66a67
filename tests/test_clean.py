"""`zeroshard clean`: lists, then removes, leftovers of dead writers; never a live writer's,
never an interrupted swap's stage, never a committed checkpoint."""

import json
import os
import subprocess
import sys
import time

from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.storage.claim import CLAIM_NAME
from zeroshard.storage.leftovers import SWAP_MARKER
from zeroshard.storage.owner import host_id, owner_tag

from checkpoints import training_state, write_checkpoint


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
