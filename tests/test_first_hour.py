"""The commands and API a new user reaches for first (issue 19): inspect --tensors, ls, diff,
zeroshard.load_state_dict / open_tensors, and an s3:// path without the s3 extra."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import zeroshard
from zeroshard.cli import main

from checkpoints import training_state, write_checkpoint

TIER = "mixed"  # docs/TESTING.md


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def run_root(tmp_path):
    """A root with two committed checkpoints (world 2 and 3), `latest`, and two leftovers."""
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "run" / "step-5"), specs, data, 2, aliases={"lm_head.weight": "embed.weight"})
    write_checkpoint(str(tmp_path / "run" / "step-7"), specs, data, 3)
    (tmp_path / "run" / "latest").write_text("step-7\n")
    (tmp_path / "run" / "step-9").mkdir()
    (tmp_path / "run" / "step-9" / "rank-00000-of-00002.safetensors").write_bytes(b"x")
    (tmp_path / "run" / ".zeroshard-tmp-dead").mkdir()
    return tmp_path / "run", data


def test_inspect_tensors_lists_names_roles_dtypes_shapes_layouts(run_root):
    root, data = run_root
    code, out, _ = cli("inspect", str(root), "--tensors")
    assert code == 0
    assert re.search(r"^block\.0\.attn\.weight +param +BF16 +13x7 +flat$", out, re.M)
    assert "local (rank 2)" in out  # the RNG items of world 3
    code, out, _ = cli("inspect", str(root / "step-5"), "--tensors", "optimizer/exp_avg/*", "--json")
    rows = json.loads(out)["tensor_list"]
    assert {r["name"] for r in rows} == {k for k in data if k.startswith("optimizer/exp_avg/")}
    assert all(r["param"] and r["state"] == "exp_avg" for r in rows)
    code, out, _ = cli("inspect", str(root / "step-5"), "--tensors", "lm_head*", "--json")
    (tied,) = json.loads(out)["tensor_list"]
    assert tied["layout"] == "tied to embed.weight" and tied["shape"] == [37, 11]
    code, out, _ = cli("inspect", str(root), "--json")
    assert "tensor_list" not in json.loads(out)  # the summary stays as it was without --tensors


def test_ls_shows_steps_latest_and_what_never_committed(run_root):
    root, _ = run_root
    code, out, _ = cli("ls", str(root), "--json")
    assert code == 0
    info = {e["name"]: e for e in json.loads(out)["checkpoints"]}
    assert info["step-7"]["latest"] and not info["step-5"]["latest"]
    assert (info["step-5"]["world_size"], info["step-7"]["world_size"]) == (2, 3)
    assert info["step-5"]["step"] == 7 and info["step-5"]["bytes"] > 0
    assert info["step-9"]["status"] == "incomplete"
    assert info[".zeroshard-tmp-dead"]["status"] == "orphaned"
    code, out, _ = cli("ls", str(root))
    assert "* step-7" in out and "INCOMPLETE" in out and "ORPHANED" in out
    (root / "latest").write_text("step-9\n")  # `latest` naming a save that never committed
    info = json.loads(cli("ls", str(root), "--json")[1])
    assert [e["status"] for e in info["checkpoints"] if e["latest"]] == ["incomplete", "missing"]
    code, _, err = cli("ls", str(root / "nope"))
    assert code == 1 and "no such folder" in err


def test_diff_compares_across_world_sizes_and_exits_by_tolerance(run_root, tmp_path):
    root, data = run_root
    code, out, _ = cli("diff", str(root / "step-5"), str(root / "step-7"), "--all")  # world 2 against world 3
    assert code == 0 and "equal" in out
    specs, _ = training_state()
    changed = dict(data, **{"embed.weight": data["embed.weight"] + 1e-3})
    write_checkpoint(str(tmp_path / "moved"), specs, changed, 4)
    code, out, _ = cli("diff", str(root / "step-5"), str(tmp_path / "moved"))
    assert code == 3 and "DIFF  embed.weight" in out and "1 differ" in out
    report = json.loads(cli("diff", str(root / "step-5"), str(tmp_path / "moved"), "--json")[1])
    (embed,) = [t for t in report["tensors"] if t["name"] == "embed.weight"]
    assert embed["max_abs"] == pytest.approx(1e-3, rel=1e-3) and not embed["close"]
    assert cli("diff", str(root / "step-5"), str(tmp_path / "moved"), "--atol", "2e-3")[0] == 0
    write_checkpoint(str(tmp_path / "fewer"), [s for s in specs if s.name != "block.0.tiny"], data, 2)
    code, out, _ = cli("diff", str(root / "step-5"), str(tmp_path / "fewer"))
    assert code == 3 and "ONLY IN A  block.0.tiny" in out


def test_diff_of_complex_tensors_sees_the_imaginary_part(tmp_path):
    from safetensors.torch import save_file

    freqs = torch.polar(torch.ones(3, 2), torch.arange(6.0).reshape(3, 2))
    for name, value in (("a", freqs), ("b", freqs + 1e-3j)):  # the real parts are equal
        save_file({"freqs_cis": value}, str(tmp_path / f"{name}.safetensors"))
        assert cli("shard", str(tmp_path / f"{name}.safetensors"), str(tmp_path / name), "--world", "2")[0] == 0
    code, out, _ = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    (freqs_cis,) = json.loads(out)["tensors"]
    assert code == 3 and freqs_cis["max_abs"] == pytest.approx(1e-3, rel=1e-3)


def test_load_state_dict_needs_no_process_group(run_root):
    root, data = run_root
    assert not torch.distributed.is_initialized()
    state = zeroshard.load_state_dict(str(root))  # follows latest: the world-3 checkpoint
    params = {k for k in data if not k.startswith("optimizer/")}
    assert set(state) == params
    assert all(state[k].dtype == data[k].dtype and state[k].equal(data[k]) for k in state)
    tied = zeroshard.load_state_dict(str(root / "step-5"), names="*.weight")
    assert tied["lm_head.weight"].equal(data["embed.weight"])
    cast = zeroshard.load_state_dict(str(root), names=["block.0.*"], exclude="*.tiny", dtype="bf16",
                                     strip_prefix="block.0.")
    assert set(cast) == {"attn.weight", "attn.bias", "norm.scale"}
    assert all(t.dtype == torch.bfloat16 for t in cast.values())
    with zeroshard.open_tensors(str(root), roles=None) as ckpt:
        assert ckpt["optimizer/exp_avg/head.weight"].equal(data["optimizer/exp_avg/head.weight"])
        assert ckpt.info("head.weight").shape == (3, 4, 5)
        with pytest.raises(zeroshard.CheckpointError, match="no tensor 'nope'"):
            ckpt["nope"]
    with pytest.raises(zeroshard.CheckpointError, match="no tensor matches"):
        zeroshard.load_state_dict(str(root), names="nope*")
    with pytest.raises(zeroshard.ZeroshardError, match="dtype"):
        zeroshard.load_state_dict(str(root), dtype="int3")


@pytest.mark.s3
def test_load_state_dict_and_ls_on_s3(run_root, s3_bucket):
    root, data = run_root
    url = f"{s3_bucket}/run"
    assert cli("reshard", str(root / "step-7"), "--to", "2", "-o", f"{url}/step-7", "-q")[0] == 0
    state = zeroshard.load_state_dict(url + "/step-7", names="embed.weight")
    assert state["embed.weight"].equal(data["embed.weight"])
    code, out, _ = cli("ls", url, "--json")
    assert code == 0 and [e["world_size"] for e in json.loads(out)["checkpoints"]] == [2]


def test_an_s3_path_without_s3fs_says_to_install_the_extra():
    code = ("import sys; sys.modules['s3fs'] = None\n"  # as if s3fs were not installed
            "import zeroshard, zeroshard.cli, zeroshard.toolkit.consolidate\n"
            "from click.testing import CliRunner\n"
            "r = CliRunner().invoke(zeroshard.cli.main, ['inspect', 's3://bucket/run'])\n"
            "print(r.exit_code); print(r.stderr.strip())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "1", "zeroshard: error: s3://bucket/run: s3:// paths need the s3 extra: pip install 'zeroshard[s3]'"]


def _save_mid_window(rank: int, world_size: int, root: str) -> dict:
    import zeroshard.deepspeed as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                  config={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2})

    def micro_step(e):
        e.backward(e(torch.randn(3, 4)).pow(2).mean())
        e.step()

    out = {}
    micro_step(engine)  # one micro-batch of two: gradients accumulated, no update yet
    try:
        engine.save_checkpoint(f"{root}/native")
    except zeroshard.EngineUsageError as exc:
        out["refused"] = str(exc)
    out["nothing_written"] = not os.path.exists(f"{root}/native")
    micro_step(engine)  # the window completes: saving is right now
    out["saved"] = os.path.basename(engine.save_checkpoint(f"{root}/native"))
    ds, _, _, _ = deepspeed.initialize(model=torch.nn.Linear(4, 2), config={
        "train_batch_size": 4 * world_size, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    micro_step(ds)
    out["deepspeed_saved"] = ds.save_checkpoint(f"{root}/ds")  # DeepSpeed's behaviour: saved, no error
    return out


def test_a_save_between_accumulation_boundaries_is_refused(tmp_path):
    from distributed import run_ranks

    results = run_ranks(_save_mid_window, 2, timeout=180, init_process_group=False, root=str(tmp_path))
    for out in results:
        assert out["refused"].startswith("save_checkpoint at micro-step 1 of 2 of global step 1:")
        assert out["nothing_written"] and out["saved"] == "step-00000001" and out["deepspeed_saved"] is True


def test_errors_say_what_to_do_next(run_root, tmp_path):
    root, _ = run_root
    data = Path(__file__).parent / "data" / "deepspeed" / "stage2"
    for args in (("inspect", str(data)), ("consolidate", str(data / "global_step3"), str(tmp_path / "o.safetensors"))):
        code, _, err = cli(*args)
        assert code == 1 and len(err.strip().splitlines()) == 1
        assert "zeroshard import deepspeed" in err, err
    dcp = tmp_path / "fsdp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\x80\x04.")
    (dcp / "__0_0.distcp").write_bytes(b"")
    code, _, err = cli("inspect", str(dcp))
    assert code == 1 and f"zeroshard import dcp {dcp} OUT" in err
    torch.save({"w": torch.ones(3)}, tmp_path / "pytorch_model.bin")
    code, _, err = cli("inspect", str(tmp_path / "pytorch_model.bin"))
    assert code == 1 and f"zeroshard shard {tmp_path / 'pytorch_model.bin'} OUT --world N" in err, err
    torch.save({"w": torch.ones(3)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    code, _, err = cli("shard", str(tmp_path / "old.pt"), str(tmp_path / "x"), "--world", "2")
    assert code == 1 and "legacy (before 1.6) format" in err and not (tmp_path / "x").exists(), err
    code, _, err = cli("inspect", str(root / "step-9"))  # a save that never committed: no hint invented
    assert code == 1 and "import" not in err


def test_mistakes_are_caught_before_anything_is_written(run_root, tmp_path):
    root, _ = run_root
    code, _, err = cli("consolidate", str(root), str(tmp_path / "model.bin"))
    assert code == 1 and "writes safetensors, not bin" in err and not (tmp_path / "model.bin").exists()
    code, _, err = cli("reshard", str(root), "--to", "1000", "-o", str(tmp_path / "wide"))  # largest tensor: 407
    assert code == 1 and "593 would hold no element of any tensor" in err and not (tmp_path / "wide").exists()
    code, out, _ = cli("consolidate", str(root), str(tmp_path / "model.safetensors"), "-q")
    assert code == 0 and out.strip().endswith(f"from {root}/step-7 (step 7, world 3)")
    code, _, err = cli("clean", str(tmp_path / "typo"))
    assert code == 1 and "typo: no such folder" in err


def test_estimate_plot_draws_the_papers_picture(tmp_path):
    pytest.importorskip("matplotlib", reason="the test extra installs matplotlib (the plot extra)")
    code, out, _ = cli("estimate", "--params", "7.5B", "--gpus", "64", "--plot", str(tmp_path / "z.png"))
    assert code == 0 and "1.88" in out and f"wrote {tmp_path / 'z.png'}" in out
    assert (tmp_path / "z.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from zeroshard.estimate_plot import device_counts

    assert device_counts(64)[:3] == [1, 2, 4] and 64 in device_counts(64) and device_counts(3000)[-1] >= 4 * 3000


def test_estimate_plot_without_matplotlib_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import importlib.util; importlib.util.find_spec = lambda name, *a: None\n"  # as if not installed
            "from click.testing import CliRunner; from zeroshard.cli import main\n"
            "r = CliRunner().invoke(main, ['estimate', '--params', '1B', '--gpus', '8', '--plot', sys.argv[1]])\n"
            "print(r.exit_code); print(r.output.strip())\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.png")], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == ["1", "Error: --plot needs the plot extra: pip install 'zeroshard[plot]'"]
    assert not (tmp_path / "p.png").exists()


def _torchrun(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


CHILD = """
import os, subprocess, sys
rank = os.environ["RANK"]
# a program torchrun started, running the CLI itself: the CLI must not join a group of its own
done = subprocess.run([sys.executable, "-m", "zeroshard.cli", "reshard", sys.argv[1], f"single-{rank}", "--to", "2",
                       "-q"], capture_output=True, text=True, timeout=120)
assert done.returncode == 0 and "over 2 ranks" in done.stdout, done.stderr
"""


@pytest.mark.slow
def test_one_cli_under_torchrun(run_root, tmp_path):
    root, _ = run_root
    proc = _torchrun(tmp_path, "-m", "zeroshard.cli", "reshard", str(root), "wide", "--world", "5", "-q",
                     "-S", "zeroshard_read_ahead=2")  # options the single-process form has, under torchrun
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1  # rank 0 reports
    assert cli("diff", str(root), str(tmp_path / "wide"), "--all")[0] == 0
    assert json.loads(cli("inspect", str(tmp_path / "wide"), "--json")[1])["world_size"] == 5
    (tmp_path / "child.py").write_text(CHILD)
    proc = _torchrun(tmp_path, "child.py", str(root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(cli("diff", str(root), str(tmp_path / f"single-{r}"))[0] == 0 for r in (0, 1))


@pytest.mark.parametrize("rank_major", [True, False], ids=["files-read-whole", "per-tensor"])
def test_the_readers_check_every_byte(run_root, tmp_path, monkeypatch, rank_major):
    import zeroshard.toolkit.load as load

    root, data = run_root
    if not rank_major:
        monkeypatch.setattr(load, "SMALL_FILE_BYTES", 0)  # every file "big": the per-tensor path
    assert zeroshard.load_state_dict(str(root))["embed.weight"].equal(data["embed.weight"])
    assert cli("diff", str(root / "step-5"), str(root), "--all")[0] == 0
    victim = root / "step-7" / "rank-00001-of-00003.safetensors"
    raw = bytearray(victim.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8:8 + header_len])["embed.weight"]["data_offsets"]
    raw[8 + header_len + begin] ^= 0xFF  # one byte of rank 1's fragment of embed.weight
    victim.write_bytes(bytes(raw))
    with pytest.raises(zeroshard.CheckpointError, match="hash mismatch"):
        zeroshard.load_state_dict(str(root), roles=None)
    code, _, err = cli("diff", str(root / "step-5"), str(root), "--all")
    assert code == 1 and "hash mismatch" in err
