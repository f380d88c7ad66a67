"""The wheel users install: built from the source, installed into a fresh venv that already has
torch, and run from there (not from this source tree): the CLI, a shard/reshard/consolidate round
trip and a 2-rank training step. Also: pip would install no other torch, and s3fs is optional.

The fresh venv sees this environment's packages through a folder of links (minus zeroshard and
s3fs), as a user's environment would hold their own torch. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

TIER = "slow"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = ("zeroshard", "__editable__", "_zeroshard", "s3fs")  # what the fresh venv must not see from here


def _run(cmd: list[str], cwd: Path, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as popen:  # its own group: a hang kills every child too
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            out, err = popen.communicate()
            raise AssertionError(f"{cmd} hung for {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the package sources (the worktree stays clean)."""
    pytest.importorskip("setuptools", reason="the test extra installs setuptools to build the wheel")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "zeroshard", src / "zeroshard", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp / "dist"), "./src"], cwd=tmp)
    (built,) = (tmp / "dist").glob("zeroshard-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding this environment's packages (torch included) but not zeroshard or s3fs;
    the wheel installed into it with pip."""
    tmp = tmp_path_factory.mktemp("venv")
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], cwd=tmp)
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    links = tmp / "theirs"
    links.mkdir()
    for entry in Path(site).iterdir():
        if not entry.name.lower().startswith(HIDDEN) and entry.suffix != ".pth":
            (links / entry.name).symlink_to(entry)
    (fresh_site,) = (env_dir / "lib").glob("python*/site-packages")
    (fresh_site / "their_packages.pth").write_text(f"{links}\n")
    python = str(env_dir / "bin" / "python")
    # What pip would install for `pip install zeroshard` here: zeroshard alone, never a torch.
    report = tmp / "report.json"
    pins = tmp / "constraints.txt"  # the project's pins but torch's: this environment's torch is the user's
    pins.write_text("".join(line for line in (ROOT / "tools" / "constraints.txt").read_text().splitlines(True)
                            if not line.startswith("torch==")))
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--dry-run", "--no-index",
          "-c", str(pins), "--report", str(report), str(wheel)], cwd=tmp)
    planned = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert planned == ["zeroshard"], planned
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", "--no-deps", str(wheel)],
         cwd=tmp)
    return env_dir


def test_the_wheel_ships_the_package_and_its_promises(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "zeroshard/py.typed" in names and "zeroshard/cli.py" in names
    assert not [n for n in names if n.startswith(("tests/", "tools/", "samples/", "docs/")) or "__pycache__" in n]
    assert "zeroshard = zeroshard.cli:main" in entry_points
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    torch_req = [r for r in requires if r.startswith("torch")]
    assert torch_req == ["torch>=2.8"], torch_req  # a floor, never a pin: the user's own torch stays
    assert [r for r in requires if r.startswith("s3fs")] == [r for r in requires if r.startswith("s3fs")
                                                              and "extra ==" in r]
    assert any(r.startswith("s3fs") and 'extra == "s3"' in r for r in requires)
    assert any(r.startswith("matplotlib") and 'extra == "plot"' in r for r in requires)


def test_the_installed_cli_runs_from_the_venv(venv, tmp_path):
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "zeroshard")
    where = _run([python, "-c", "import zeroshard; print(zeroshard.__file__)"], cwd=tmp_path).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed package, not this source tree
    assert _run([python, "-c", "import s3fs"], cwd=tmp_path, check=False).returncode != 0  # s3fs is optional
    assert "consolidate" in _run([cli, "--help"], cwd=tmp_path).stdout

    # shard -> reshard -> consolidate, from the installed command, bit-exact
    _run([python, "-c", "import torch; from safetensors.torch import save_file; g = torch.Generator().manual_seed(0);"
          "save_file({'a.weight': torch.randn(7, 5, generator=g), 'b': torch.arange(11.0)}, 'm.safetensors')"],
         cwd=tmp_path)
    _run([cli, "shard", "m.safetensors", "ck", "--world", "2", "-q"], cwd=tmp_path)
    _run([cli, "reshard", "ck", "--to", "3", "-o", "ck3", "-q"], cwd=tmp_path)
    _run([cli, "consolidate", "ck3", "out.safetensors", "-q"], cwd=tmp_path)
    _run([python, "-c", "from safetensors.torch import load_file; a, b = load_file('m.safetensors'), "
          "load_file('out.safetensors'); assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)"],
         cwd=tmp_path)

    # an s3:// path without the s3 extra: one line saying what to install
    proc = _run([cli, "inspect", "s3://bucket/run"], cwd=tmp_path, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "zeroshard: error: s3://bucket/run: s3:// paths need the s3 extra: pip install 'zeroshard[s3]'"]


TRAIN = """
import torch, torch.distributed as dist, zeroshard
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                              config={"zero_optimization": {"stage": 3}})
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
engine.backward(engine(x).pow(2).mean())
engine.step()
engine.save_checkpoint("run")
assert engine.global_steps == 1
"""


def test_a_two_rank_training_step_from_the_installed_package(venv, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"],
         cwd=tmp_path, timeout=120)
    info = json.loads(_run([str(venv / "bin" / "zeroshard"), "inspect", "run", "--json"], cwd=tmp_path).stdout)
    assert info["world_size"] == 2 and info["step"] == 1, info


@pytest.mark.s3
def test_the_s3_extra_against_moto(venv, tmp_path, s3_bucket):
    """Last here: it gives the venv s3fs (as `pip install 'zeroshard[s3]'` would) and uses it on moto."""
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (extra := tmp_path / "s3_extra").mkdir()
    for entry in Path(site).iterdir():
        if entry.name.lower().startswith("s3fs"):
            (extra / entry.name).symlink_to(entry)
    (fresh_site,) = (venv / "lib").glob("python*/site-packages")
    (fresh_site / "s3_extra.pth").write_text(f"{extra}\n")
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "zeroshard")
    _run([python, "-c", "import torch; from safetensors.torch import save_file;"
          "save_file({'w': torch.arange(12.0).reshape(3, 4)}, 'm.safetensors')"], cwd=tmp_path)
    _run([cli, "shard", "m.safetensors", f"{s3_bucket}/ck", "--world", "2", "-q"], cwd=tmp_path)
    _run([cli, "consolidate", f"{s3_bucket}/ck", "out.safetensors", "-q"], cwd=tmp_path)
    _run([python, "-c", "from safetensors.torch import load_file; import torch;"
          "assert load_file('out.safetensors')['w'].equal(torch.arange(12.0).reshape(3, 4))"], cwd=tmp_path)


def test_pyproject_builds_with_the_setuptools_a_cuda_environment_already_has() -> None:
    """`pip install --no-build-isolation .` uses the environment's own setuptools. A PEP 639 license
    string (`license = "Apache-2.0"`) needs setuptools >= 77; 65 refused it ("`project.license`
    must be valid exactly by one definition"). [project] itself needs 61."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["build-system"]["requires"] == ["setuptools>=61"]
    assert not isinstance(meta["project"].get("license"), str)
    assert "license-files" not in meta["project"]  # PEP 639 too


def test_the_declared_torch_floor_is_the_one_tools_dev_sh_floor_tests():
    import re

    declared = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    tested = re.search(r"^FLOOR_TORCH=([0-9.]+)$", (ROOT / "tools" / "dev.sh").read_text(), re.M).group(1)
    assert tested.split(".")[:2] == declared.split(".")[:2], (declared, tested)
    assert f"`torch>={declared}`" in (ROOT / "README.md").read_text()  # and the README says the same
    from zeroshard.torch_version import TORCH_FLOOR

    assert ".".join(map(str, TORCH_FLOOR)) == declared  # and the refusal below it (zeroshard/torch_version.py)
