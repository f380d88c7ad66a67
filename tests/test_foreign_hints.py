"""A DeepSpeed or DCP folder given to consolidate/inspect/verify/reshard: one line saying which
`zeroshard import` command converts it (issue 18), and nothing written."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from zeroshard.cli import main

TIER = "default"  # docs/TESTING.md

DEEPSPEED = Path(__file__).parent / "data" / "deepspeed" / "stage1"
COMMANDS = [("inspect",), ("verify",), ("consolidate", "{out}/model.safetensors"), ("reshard", "--to", "2", "-o",
                                                                                   "{out}/resharded")]


def _run(command: tuple[str, ...], src: Path, out: Path) -> tuple[int, str]:
    args = [a.format(out=out) for a in command]
    result = CliRunner().invoke(main, [args[0], str(src), *args[1:]], catch_exceptions=False)
    return result.exit_code, result.output


def _dcp_folder(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(4, 3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))  # no process group: one writer
    return tmp_path / "dcp"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
@pytest.mark.parametrize("which", ["deepspeed root", "deepspeed tag", "dcp", "accelerate", "trainer run",
                                   "accelerate full state"])
def test_a_foreign_folder_gets_the_import_command_to_run(tmp_path: Path, command: tuple[str, ...], which: str):
    """The command names the folder given: a root holding `latest` (Accelerate's save_state, whose
    tag folder is `pytorch_model/`) rather than the tag folder inside it; for a Trainer run folder
    (which import refuses when it holds several) its newest checkpoint-N."""
    target = None
    if which == "dcp":
        src, kind = _dcp_folder(tmp_path), "dcp"
    elif which == "accelerate full state":  # FULL_STATE_DICT: two pickles, no DCP folder
        (tmp_path / "full").mkdir()
        torch.save(torch.nn.Linear(4, 3).state_dict(), tmp_path / "full" / "pytorch_model_fsdp.bin")
        src, kind = tmp_path / "full", "dcp"
    else:
        fixture = {"accelerate": "accelerate", "trainer run": "hf_trainer"}.get(which, "stage1")
        shutil.copytree(DEEPSPEED.parent / fixture, tmp_path / "ds")
        src, kind = (tmp_path / "ds" / "global_step3" if which == "deepspeed tag" else tmp_path / "ds"), "deepspeed"
        target = tmp_path / "ds" / "checkpoint-3" if which == "trainer run" else None
    before = sorted((p.relative_to(src), p.stat().st_size) for p in src.rglob("*"))
    out = tmp_path / "out"
    out.mkdir()
    code, output = _run(command, src, out)
    assert code != 0 and "Traceback" not in output, output
    assert f"`zeroshard import {kind} {target or src} OUT`" in output, output
    assert len(output.strip().splitlines()) == 1, output
    assert sorted((p.relative_to(src), p.stat().st_size) for p in src.rglob("*")) == before
    assert list(out.iterdir()) == []


def test_an_empty_folder_is_still_not_a_checkpoint(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    code, output = _run(("inspect",), tmp_path / "empty", tmp_path)
    assert code != 0 and "not a zeroshard checkpoint: neither zeroshard.json nor latest found" in output, output


def test_an_import_that_fails_is_not_told_to_run_an_import(tmp_path: Path):
    shutil.copytree(DEEPSPEED, tmp_path / "ds")
    for victim in (tmp_path / "ds" / "global_step3").glob("*optim_states.pt"):
        victim.unlink()  # the import fails on the tag folder, which still looks like a DeepSpeed checkpoint
    result = CliRunner().invoke(main, ["import", "deepspeed", str(tmp_path / "ds"), str(tmp_path / "out")],
                                catch_exceptions=False)
    assert result.exit_code != 0 and "optimizer files" in result.output, result.output
    assert "convert it with" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_ls_names_foreign_checkpoints_and_their_import(tmp_path: Path):
    """`zeroshard ls` of a folder of DeepSpeed saves, an Accelerate save_state and an HF Trainer
    run: each is FOREIGN with the import command to run, not "not a checkpoint"."""
    for name in ("stage1", "accelerate", "hf_trainer"):
        shutil.copytree(DEEPSPEED.parent / name, tmp_path / "runs" / name)
    (tmp_path / "runs" / "notes").mkdir()
    result = CliRunner().invoke(main, ["ls", str(tmp_path / "runs")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    runs = tmp_path / "runs"
    for name, source in (("stage1", runs / "stage1"), ("accelerate", runs / "accelerate"),
                         ("hf_trainer", runs / "hf_trainer" / "checkpoint-3")):
        line = next(line for line in result.output.splitlines() if line.strip().startswith(name))
        assert "FOREIGN: " in line and f"`zeroshard import deepspeed {source} OUT`" in line, line
    assert "notes                    OTHER: not a checkpoint" in result.output, result.output
