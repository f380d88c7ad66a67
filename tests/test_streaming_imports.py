"""Streaming foreign imports (issue 18): a range of a big tensor reads only that range's bytes
from the source files, and what is read is bit-exact against torch's own whole-file readers."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch

from zeroshard.interop import torch_zip
from zeroshard.interop.imported import LazyTensor, materialize

TIER = "default"  # docs/TESTING.md


def test_dcp_range_reads_only_its_bytes(tmp_path, bytes_read):
    import torch.distributed.checkpoint as dcp

    from zeroshard.interop.dcp_import import read_dcp

    g = torch.Generator().manual_seed(0)
    saved = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(1024, generator=g)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": saved}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
        back = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
        dcp.load(back, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # torch's own reader
    imp = read_dcp(str(tmp_path / "dcp"))
    w = imp.params["w"]
    assert isinstance(w, LazyTensor)
    bytes_read.clear()
    part = w.read(10 * 1024 + 5, 12 * 1024)  # inside rows 10 and 11
    assert torch.equal(part, back["model"]["w"].reshape(-1)[10 * 1024 + 5: 12 * 1024])
    assert bytes_read == [(2 * 1024 - 5) * 4]  # the range's bytes of the 4 MiB chunk, nothing else
    assert torch.equal(w.materialize(), back["model"]["w"]) and torch.equal(imp.params["b"], back["model"]["b"])


SHAPES = {"a": (300, 70), "b": (1000,), "c": (257, 33), "d": (5,), "e": (64, 64)}


@pytest.fixture
def synthetic_stage3(tmp_path):
    """A 3-rank ZeRO-3 checkpoint, 3 sub-groups, made by tools/bench_import.py's make_deepspeed."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
    try:
        import bench_import
    finally:
        sys.path.pop(0)
    values = bench_import.seeded_values(SHAPES)
    bench_import.make_deepspeed(tmp_path / "ds", SHAPES, 3, values, per_group=2)
    return tmp_path / "ds", values


def test_deepspeed_stage3_is_read_lazily_and_bit_exact(synthetic_stage3, monkeypatch, bytes_read):
    from zeroshard.interop.deepspeed_ckpt import read_deepspeed

    src, values = synthetic_stage3
    eager = read_deepspeed(str(src))
    assert not any(isinstance(v, LazyTensor) for v in eager.params.values())  # all under 1 MiB
    monkeypatch.setattr(torch_zip, "LAZY_BYTES", 4096)
    bytes_read.clear()
    lazy = read_deepspeed(str(src))
    assert {n for n, v in lazy.params.items() if isinstance(v, LazyTensor)} == {"a", "c", "e"}
    assert max(bytes_read) < 4096  # only small tensors and the 0-d steps were read so far
    for name, shape in SHAPES.items():
        for imp in (eager, lazy):
            assert torch.equal(materialize(imp.params[name]), values(name, "fp32")), name
            assert tuple(imp.params[name].shape) == shape
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(materialize(imp.optimizer_state[name][kind]), values(name, kind).reshape(-1))
            assert imp.scalar_state[name] == {"step": {"dtype": "F32", "value": 3.0}}
    assert lazy.world_size == 3 and lazy.zero_stage == 3 and lazy.global_steps == 3


def _fragment_hashes(path: Path) -> dict:
    from zeroshard.format import CheckpointReader, open_checkpoint

    location, manifest = open_checkpoint(str(path))
    with CheckpointReader(location, manifest) as reader:
        return {rank: reader.fragment_hashes(rank) for rank in range(manifest.world_size)}


@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_import_holds_a_window_not_the_model(tmp_path, synthetic_stage3, monkeypatch, bytes_read, world):
    """Written through the CLI with a 4 kB window: no read is bigger than the window, each byte
    of the source is read once, and the output equals the import that reads everything at once."""
    from click.testing import CliRunner

    from zeroshard.cli import main
    from zeroshard.interop import write

    src, _ = synthetic_stage3
    runner = CliRunner()
    eager = runner.invoke(main, ["import", "deepspeed", str(src), str(tmp_path / "eager"), "--world", str(world), "-q"])
    assert eager.exit_code == 0, eager.output
    monkeypatch.setattr(torch_zip, "LAZY_BYTES", 4096)
    monkeypatch.setattr(write, "WINDOW_BYTES", 4096)
    bytes_read.clear()
    lazy = runner.invoke(main, ["import", "deepspeed", str(src), str(tmp_path / "lazy"), "--world", str(world), "-q"])
    assert lazy.exit_code == 0, lazy.output
    data = 3 * 4 * sum(math.prod(s) for s in SHAPES.values())  # fp32 + 2 moments, padding never read
    steps = 4 * 3 * 3  # a 0-d step per sub-group per rank
    assert max(bytes_read) <= 4096 and sum(bytes_read) == data + steps
    assert _fragment_hashes(tmp_path / "lazy") == _fragment_hashes(tmp_path / "eager")
