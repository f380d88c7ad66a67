"""Workers of the right kind: threads for big files (their work releases the GIL), spawned
processes for many small ones; either way the same bytes, and a failure leaves nothing."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_scale import leftovers

from zeroshard.errors import CheckpointError
from zeroshard.toolkit import transfer, workers
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.shard import shard
from zeroshard.toolkit.verify import verify

from checkpoints import read_checkpoint
from test_bad_input import flip_byte_in
from test_roundtrip import assert_same


def test_pool_kind_follows_file_size():
    with workers.worker_pool(2, [workers.BIG_FILE_BYTES] * 3) as pool:
        assert type(pool).__name__ == "ThreadPoolExecutor"
    with workers.worker_pool(2, [workers.BIG_FILE_BYTES, 1000]) as pool:
        assert type(pool).__name__ == "ProcessPoolExecutor"


@pytest.fixture
def big_files(monkeypatch):
    """Every file counts as big (threads) and goes through the windowed copy; records the pools."""
    monkeypatch.setattr(workers, "BIG_FILE_BYTES", 1)
    monkeypatch.setattr(transfer, "WINDOW_BYTES", 4096)
    monkeypatch.setattr(transfer, "STEP_BYTES", 1024)
    kinds = []
    original = workers.worker_pool

    def spy(count, sizes):
        pool = original(count, sizes)
        kinds.append(type(pool).__name__)
        return pool

    monkeypatch.setattr(transfer, "worker_pool", spy)
    monkeypatch.setattr(workers, "worker_pool", spy)
    return kinds


@pytest.fixture
def model(tmp_path):
    g = torch.Generator().manual_seed(11)
    tensors = {f"t{i}": torch.randn(700 + 131 * i, generator=g) for i in range(12)}
    tensors["half"] = torch.randn(999, generator=g).half()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "w4"), 4)
    return tensors


def test_thread_workers_give_the_same_bytes(tmp_path, model, big_files):
    for to in (3, 8):
        reshard(str(tmp_path / "w4"), to, str(tmp_path / f"one{to}"))
        reshard(str(tmp_path / "w4"), to, str(tmp_path / f"two{to}"), workers=2)
        assert verify(str(tmp_path / f"two{to}"), workers=2, deep=True).ok
        assert_same(read_checkpoint(str(tmp_path / f"one{to}")), read_checkpoint(str(tmp_path / f"two{to}")))
    consolidate(str(tmp_path / "w4"), str(tmp_path / "a.safetensors"))
    consolidate(str(tmp_path / "w4"), str(tmp_path / "b.safetensors"), workers=2)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert_same(model, load_file(tmp_path / "b.safetensors"))
    assert big_files and set(big_files) == {"ThreadPoolExecutor"}
    assert not leftovers(tmp_path)


def test_a_failing_thread_worker_leaves_nothing(tmp_path, model, big_files):
    flip_byte_in(tmp_path / "w4" / "rank-00002-of-00004.safetensors", "t5")
    with pytest.raises(CheckpointError, match="rank-00002-of-00004.safetensors"):
        reshard(str(tmp_path / "w4"), 8, str(tmp_path / "r8"), workers=2)
    assert not (tmp_path / "r8" / "zeroshard.json").exists()
    with pytest.raises(CheckpointError, match="rank-00002-of-00004.safetensors"):
        consolidate(str(tmp_path / "w4"), str(tmp_path / "m2.safetensors"), workers=2)
    assert not (tmp_path / "m2.safetensors").exists()
    report = verify(str(tmp_path / "w4"), workers=2)
    assert report.problems and all("rank-00002-of-00004.safetensors" in p for p in report.problems)
    assert set(big_files) == {"ThreadPoolExecutor"}
    assert not leftovers(tmp_path)
