"""Streaming foreign imports (issue 18): a range of a big tensor reads only that range's bytes
from the source files, and what is read is bit-exact against torch's own whole-file readers."""

from __future__ import annotations

import warnings

import pytest
import torch

from zeroshard.interop import torch_zip
from zeroshard.interop.imported import LazyTensor


@pytest.fixture
def bytes_read(monkeypatch) -> list[int]:
    """Every storage read of torch_zip (the bytes of tensors, not of zip directories or pickles)."""
    read: list[int] = []
    original = torch_zip.Source.read_into

    def counting(self, tensor, offset):
        read.append(tensor.numel())
        original(self, tensor, offset)

    monkeypatch.setattr(torch_zip.Source, "read_into", counting)
    return read


def test_dcp_range_reads_only_its_rows(tmp_path, bytes_read):
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
    assert bytes_read == [2 * 1024 * 4]  # two rows of the 4 MiB chunk, nothing else
    assert torch.equal(w.materialize(), back["model"]["w"]) and torch.equal(imp.params["b"], back["model"]["b"])
