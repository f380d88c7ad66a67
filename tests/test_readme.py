"""The Python in README.md and docs/*.md that is meant to run, run: a wrong snippet fails here.

A block runs when the line before its ```python fence is a marker:

    <!-- runnable -->               python, alone
    <!-- runnable: torchrun 2 -->   under torchrun with 2 CPU ranks (gloo)

A file's runnable blocks run in order in one scratch folder, so a later block may use what an
earlier one wrote (the training snippet's checkpoint, say). The README's training snippet also
resumes exactly: interrupted and resumed, it ends where an uninterrupted run ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

TIER = "slow"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
sys.path.insert(0, str(ROOT / "tools"))
from runnable_blocks import runnable_blocks  # noqa: E402  (shared with tools/gpu_suite.py)


def run_block(code: str, ranks: int, cwd: Path, env_extra: dict[str, str] | None = None,
              timeout: float = 240) -> None:
    script = cwd / "snippet.py"
    script.write_text(code)
    cmd = [sys.executable, str(script)] if not ranks else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env_extra or {}))
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:  # own group: a hang kills the ranks too
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"snippet hung for {timeout} s:\n{code}\n{out[-3000:]}") from None
    assert proc.returncode == 0, f"snippet failed ({proc.returncode}):\n{code}\n{out[-4000:]}"


def test_the_readme_has_runnable_snippets():
    blocks = runnable_blocks(ROOT / "README.md")
    assert [b for b in blocks if b[1] and "save_checkpoint" in b[2]], "the training snippet must be runnable"
    assert len(blocks) >= 2


@pytest.mark.parametrize("doc", [p for p in DOCS if runnable_blocks(p)], ids=lambda p: p.name)
def test_runnable_snippets_run(doc: Path, tmp_path):
    for line, ranks, code in runnable_blocks(doc):
        try:
            run_block(code, ranks, tmp_path)
        except AssertionError as exc:
            raise AssertionError(f"{doc.name}:{line}: {exc}") from None


def _weights(ckpt: Path, out: Path) -> dict:
    from safetensors.torch import load_file

    from zeroshard.toolkit.consolidate import consolidate

    consolidate(str(ckpt), str(out), quiet=True)
    return load_file(str(out))


def test_the_training_snippet_resumes_exactly(tmp_path):
    (_, ranks, code), = [b for b in runnable_blocks(ROOT / "README.md") if b[1] and "save_checkpoint" in b[2]]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir()
    cut.mkdir()
    with ThreadPoolExecutor(1) as beside:  # the uninterrupted run beside the cut one (CI time)
        uninterrupted = beside.submit(run_block, code, ranks, whole, {"STEPS": "6"})
        run_block(code, ranks, cut, {"STEPS": "3"})  # stops after step 3: its last checkpoint is step 2
        run_block(code, ranks, cut, {"STEPS": "6"})  # resumes from step 2
        uninterrupted.result()
    latest = (whole / "ckpt" / "latest").read_text().strip()
    assert latest == (cut / "ckpt" / "latest").read_text().strip() == "step-00000006"
    a = _weights(whole / "ckpt", tmp_path / "a.safetensors")
    b = _weights(cut / "ckpt", tmp_path / "b.safetensors")
    early = _weights(whole / "ckpt" / "step-00000004", tmp_path / "early.safetensors")
    assert a.keys() == b.keys() and a
    assert all(a[k].equal(b[k]) for k in a), "the resumed run does not end where the uninterrupted one does"
    assert not all(a[k].equal(early[k]) for k in a)  # training moved the weights: the comparison means something


def _toolkit_lines(path: Path) -> list[str]:
    """Each `zeroshard ...` command in the file's ```bash blocks (comments cut, `&&` chains split)."""
    import shlex

    commands, in_bash = [], False
    for line in path.read_text().splitlines():
        if line.strip().startswith("```"):
            in_bash = line.strip() == "```bash"
            continue
        if in_bash:
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["zeroshard"]:
                    commands.append(words[1:])
    return commands


def test_the_readme_commands_parse():
    """Every toolkit command the README shows names real subcommands and options (parsed, not run)."""
    import click

    from zeroshard.cli import main

    commands = _toolkit_lines(ROOT / "README.md")
    assert len(commands) >= 10
    for args in commands:
        with warnings.catch_warnings():  # click 8.2 deprecates protected_args; 8.1 needs it
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx = main.make_context("zeroshard", list(args))
            command, rest = main, list(ctx.protected_args) + list(ctx.args)
            while isinstance(command, click.Group):  # raises click's UsageError on an unknown option
                name, command, rest = command.resolve_command(ctx, rest)
                ctx = command.make_context(name, rest, parent=ctx)
                rest = list(ctx.protected_args) + list(ctx.args)
        assert not rest, f"zeroshard {' '.join(args)}: unexpected {rest}"
