"""Many ranks and parallel workers: the rank-major paths give the same bytes with 1 or N
processes, at hundreds of ranks, and a failure in any worker leaves nothing behind."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import read_checkpoint, training_state, write_checkpoint
from test_bad_input import flip_byte_in
from test_roundtrip import assert_same
from zeroshard.errors import CheckpointError
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.shard import shard
from zeroshard.toolkit.verify import verify


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob(".zeroshard-tmp-*")]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """40 tensors of odd sizes (some smaller than the world) over 300 ranks."""
    root = tmp_path_factory.mktemp("wide")
    g = torch.Generator().manual_seed(3)
    model = {f"t{i}": torch.randn(1 + 37 * i, generator=g) for i in range(40)}
    model["half"] = torch.randn(513, generator=g).half()
    save_file(model, str(root / "m.safetensors"))
    shard(str(root / "m.safetensors"), str(root / "w300"), 300)
    return root, model


@pytest.mark.parametrize("to", [1, 7, 299, 512])
def test_reshard_many_ranks_with_workers_is_exact(wide, tmp_path, to):
    root, model = wide
    reshard(str(root / "w300"), to, str(tmp_path / "one"))
    reshard(str(root / "w300"), to, str(tmp_path / "two"), workers=2)
    assert verify(str(tmp_path / "two"), workers=2).ok
    one, two = read_checkpoint(str(tmp_path / "one")), read_checkpoint(str(tmp_path / "two"))
    assert_same(one, two)
    assert_same(model, {k: v for k, v in two.items()})
    assert not leftovers(tmp_path)


def test_consolidate_with_workers_is_bit_identical(wide, tmp_path):
    root, model = wide
    consolidate(str(root / "w300"), str(tmp_path / "a.safetensors"))
    consolidate(str(root / "w300"), str(tmp_path / "b.safetensors"), workers=3)
    consolidate(str(root / "w300"), str(tmp_path / "hf"), max_shard_size="2KB", workers=2)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert_same(model, load_file(tmp_path / "a.safetensors"))
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 3
    merged = {k: v for f in shards for k, v in load_file(f).items()}
    assert_same(model, merged)
    assert not leftovers(tmp_path)


def test_corrupt_input_fails_every_worker_cleanly(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 6)
    victim = tmp_path / "c" / "rank-00004-of-00006.safetensors"
    flip_byte_in(victim, "embed.weight")
    for workers in (1, 2):
        with pytest.raises(CheckpointError, match="rank-00004-of-00006.safetensors"):
            reshard(str(tmp_path / "c"), 5, str(tmp_path / f"r{workers}"), workers=workers)
        assert not (tmp_path / f"r{workers}" / "zeroshard.json").exists()
        with pytest.raises(CheckpointError, match="rank-00004-of-00006.safetensors"):
            consolidate(str(tmp_path / "c"), str(tmp_path / f"m{workers}.safetensors"), workers=workers)
        assert not (tmp_path / f"m{workers}.safetensors").exists()
        report = verify(str(tmp_path / "c"), workers=workers)
        assert len(report.problems) >= 1 and "rank-00004-of-00006.safetensors" in report.problems[0]
    assert not leftovers(tmp_path)


def test_dtype_cast_on_the_rank_major_path(wide, tmp_path):
    root, model = wide
    consolidate(str(root / "w300"), str(tmp_path / "bf.safetensors"), dtype="bf16", workers=2)
    out = load_file(tmp_path / "bf.safetensors")
    assert_same({k: v.bfloat16() for k, v in model.items()}, out)


def test_big_fragments_stream_through_windows(tmp_path, monkeypatch):
    """Fragments larger than the read window are copied and hash-checked window by window."""
    import zeroshard.toolkit.transfer as transfer

    monkeypatch.setattr(transfer, "WINDOW_BYTES", 4096)
    model = {"big": torch.randn(10_000), "small": torch.arange(5, dtype=torch.int64)}
    save_file(model, str(tmp_path / "m.safetensors"))
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "w2"), 2)
    reshard(str(tmp_path / "w2"), 3, str(tmp_path / "w3"))
    consolidate(str(tmp_path / "w3"), str(tmp_path / "o.safetensors"))
    assert_same(model, load_file(tmp_path / "o.safetensors"))
    assert verify(str(tmp_path / "w3")).ok


def torchrun(*args, nproc=2):
    import subprocess
    import sys

    from distributed import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           f"--master-port={free_port()}", "-m", "zeroshard.toolkit", *args],
                          capture_output=True, text=True, timeout=180, env=env)


def test_distributed_reshard_and_consolidate_under_torchrun(wide, tmp_path):
    root, model = wide
    result = torchrun("reshard", str(root / "w300"), "--to", "64", "-o", str(tmp_path / "w64"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert verify(str(tmp_path / "w64")).ok
    assert_same(model, read_checkpoint(str(tmp_path / "w64")))
    result = torchrun("consolidate", str(tmp_path / "w64"), str(tmp_path / "m.safetensors"), "-j", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    consolidate(str(root / "w300"), str(tmp_path / "ref.safetensors"))
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    result = torchrun("consolidate", str(tmp_path / "w64"), str(tmp_path / "hf"), "--max-shard-size", "3KB")
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same(model, {k: v for f in (tmp_path / "hf").glob("model-*.safetensors") for k, v in load_file(f).items()})
    assert not leftovers(tmp_path)


def test_distributed_failure_commits_nothing(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 4)
    flip_byte_in(tmp_path / "c" / "rank-00003-of-00004.safetensors", "embed.weight")
    result = torchrun("reshard", str(tmp_path / "c"), "--to", "3", "-o", str(tmp_path / "r"))
    assert result.returncode != 0
    assert "rank-00003-of-00004.safetensors" in result.stderr and "hash mismatch" in result.stderr
    assert not (tmp_path / "r" / "zeroshard.json").exists() and not leftovers(tmp_path)


def test_resident_memory_stays_at_a_window_whatever_the_outputs(tmp_path):
    """Pages of inputs and of every output are dropped as a process-wide budget fills: a reshard
    into 16 outputs stays near one budget, not near the data size (here 4 MiB, windows of 1 MiB)."""
    import subprocess
    import sys

    import numpy as np
    from safetensors.numpy import save_file as save_numpy

    save_numpy({f"w{i}": np.random.default_rng(i).standard_normal(2_000_000, dtype=np.float32) for i in range(8)},
               str(tmp_path / "m.safetensors"))  # 64 MB
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "w2"), 2)
    script = (
        "import resource, sys\n"
        "import zeroshard.storage.mapped_file as m, zeroshard.toolkit.transfer as t\n"
        "m.RELEASE_EVERY_BYTES, t.WINDOW_BYTES = 4 << 20, 1 << 20\n"
        "from zeroshard.toolkit.reshard import reshard\n"
        "from zeroshard.toolkit.consolidate import consolidate\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "reshard(sys.argv[1], 16, sys.argv[2])\n"
        "consolidate(sys.argv[2], sys.argv[3])\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "w2"), str(tmp_path / "w16"),
                             str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    grown_mib = int(result.stdout.split()[-1])
    assert grown_mib < 24, f"peak RSS grew by {grown_mib} MiB for 64 MB of data"
    assert load_file(tmp_path / "o.safetensors")["w3"].numel() == 2_000_000
