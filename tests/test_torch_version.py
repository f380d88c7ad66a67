"""Below the torch floor (zeroshard/torch_version.py) the training core and the importers refuse in
one line before anything else runs, instead of failing deep inside torch; the variable
ZEROSHARD_SKIP_TORCH_CHECK=1 turns the refusal into a warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import zeroshard
from zeroshard.torch_version import TORCH_FLOOR, require_supported_torch, torch_release

TIER = "default"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def old_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    monkeypatch.delenv("ZEROSHARD_SKIP_TORCH_CHECK", raising=False)
    require_supported_torch.cache_clear()
    yield
    require_supported_torch.cache_clear()


def test_release_parsing():
    assert torch_release("2.13.0+cpu") == (2, 13) and torch_release("2.8.0") == (2, 8)
    assert torch_release("2.16.0.dev20261101+cu130") == (2, 16) and torch_release("2.10.0a0+git1234") == (2, 10)
    assert torch_release("unknown") is None
    assert torch_release(torch.__version__) >= TORCH_FLOOR  # the torch this suite runs on passes


def test_initialize_refuses_an_older_torch_before_any_process_group(old_torch):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(zeroshard.ZeroshardError) as caught:
        zeroshard.initialize(model, torch.optim.AdamW(model.parameters()))
    message = str(caught.value)
    assert "torch>=2.8" in message and "2.6.0+cu124" in message and "ZEROSHARD_SKIP_TORCH_CHECK=1" in message
    assert "\n" not in message and not torch.distributed.is_initialized()
    with pytest.raises(zeroshard.ZeroshardError, match="torch>=2.8"):
        with zeroshard.zero_init():
            torch.nn.Linear(2, 2)


def test_an_import_refuses_an_older_torch_in_one_line(old_torch, tmp_path):
    from zeroshard.cli import main

    result = CliRunner().invoke(main, ["import", "dcp", str(ROOT / "tests/data/dcp/torch-2.6.0/plain"),
                                       str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1 and "torch>=2.8" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out" / "zeroshard.json").exists()


def test_the_variable_turns_the_refusal_into_a_warning(old_torch, monkeypatch):
    monkeypatch.setenv("ZEROSHARD_SKIP_TORCH_CHECK", "1")
    with pytest.warns(UserWarning, match="going on untested"):
        require_supported_torch()
