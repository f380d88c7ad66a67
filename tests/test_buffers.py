"""Buffers across checkpoints: their names and shapes are checked before anything is read, as
torch's load_state_dict checks them; a buffer that `zeroshard shard` or a full-model file holds
as a parameter loads back into the buffer; complex buffers (a RoPE model's freqs_cis) save,
reshard, consolidate, shard and import.

Every engine is 2 gloo CPU ranks at stage 3 (parameters partitioned, buffers whole in rank 0's
file), on a model with a float buffer, an integer one and a complex one.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import zeroshard
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.shard import shard

from distributed import run_ranks

TIER = "default"  # docs/TESTING.md


class WithBuffers(torch.nn.Module):
    """A linear layer and three persistent buffers; `buffers` renames, reshapes or drops them."""

    def __init__(self, buffers: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(4, 4)
        default = {"scale": ((4,), torch.float32), "seen": ((), torch.int64), "freqs_cis": ((3, 2), torch.complex64)}
        for name, (shape, dtype) in (default if buffers is None else buffers).items():
            value = torch.polar(torch.ones(shape), torch.randn(shape)) if dtype.is_complex else torch.zeros(shape)
            self.register_buffer(name, value.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _engine(model: torch.nn.Module) -> Any:
    return zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                config={"zero_optimization": {"stage": 3}})


def save(rank: int, world: int, ckpt: str) -> dict[str, torch.Tensor]:
    model = WithBuffers()
    with torch.no_grad():
        model.scale.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        model.seen.fill_(7)
    engine = _engine(model)
    engine.backward(engine(torch.randn(8, 4)).square().mean())
    engine.step()
    engine.save_checkpoint(ckpt)
    return engine.full_state_dict()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("buffers")
    state = run_ranks(save, 2, timeout=120, ckpt=str(root / "ckpt"))[0]
    return {"root": root, "ckpt": str(root / "ckpt"), "state": state}


def load(rank: int, world: int, ckpt: str, buffers: dict | None = None, strict: bool = True,
         pretrained: bool = False) -> dict[str, Any]:
    engine = _engine(WithBuffers(buffers, seed=1))
    before = engine.full_state_dict()
    out: dict[str, Any] = {"error": None, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if pretrained:
                engine.load_pretrained(ckpt, strict=strict)
            else:
                engine.load_checkpoint(ckpt, strict=strict)
        except zeroshard.ZeroshardError as exc:
            out["error"] = str(exc)
    out["warnings"] = [str(w.message) for w in caught if "strict=False" in str(w.message)]
    out["before"], out["after"] = before, engine.full_state_dict()
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_buffers_round_trip_at_another_world_size_complex_included(saved, tmp_path):
    reshard(saved["ckpt"], 3, str(tmp_path / "w3"))
    for ckpt in (saved["ckpt"], str(tmp_path / "w3")):
        result = run_ranks(load, 2, timeout=120, ckpt=ckpt)[0]
        assert result["error"] is None
        _assert_same(result["after"], saved["state"])
    assert saved["state"]["freqs_cis"].dtype == torch.complex64 and saved["state"]["seen"].item() == 7


def test_buffer_names_and_shapes_are_checked_before_reading(saved):
    renamed = {"scale": ((4,), torch.float32), "seen": ((), torch.int64), "freqs": ((3, 2), torch.complex64)}
    result = run_ranks(load, 2, timeout=120, ckpt=saved["ckpt"], buffers=renamed)[0]
    assert "missing from the checkpoint: freqs" in result["error"], result["error"]  # it was loaded as if present
    assert "not in the model: freqs_cis" in result["error"]

    reshaped = {"scale": ((5,), torch.float32), "seen": ((), torch.int64), "freqs_cis": ((3, 2), torch.complex64)}
    result = run_ranks(load, 2, timeout=120, ckpt=saved["ckpt"], buffers=reshaped)[0]
    assert "shape mismatch: scale (checkpoint [4], model [5])" in result["error"], result["error"]
    assert "partly overwritten" not in result["error"]  # refused before a byte was read
    _assert_same(result["after"], result["before"])

    dropped = {"scale": ((4,), torch.float32), "seen": ((), torch.int64)}
    result = run_ranks(load, 2, timeout=120, ckpt=saved["ckpt"], buffers=dropped)[0]
    assert "not in the model: freqs_cis" in result["error"], result["error"]


def test_strict_false_loads_the_buffers_that_match_and_says_which_do_not(saved):
    renamed = {"scale": ((4,), torch.float32), "seen": ((), torch.int64), "freqs": ((3, 2), torch.complex64)}
    result = run_ranks(load, 2, timeout=120, ckpt=saved["ckpt"], buffers=renamed, strict=False)[0]
    assert result["error"] is None
    assert torch.equal(result["after"]["scale"], saved["state"]["scale"])
    assert torch.equal(result["after"]["lin.weight"], saved["state"]["lin.weight"])
    assert torch.equal(result["after"]["freqs"], result["before"]["freqs"])
    [said] = result["warnings"]
    assert "keep their values (freqs)" in said and "were not loaded (freqs_cis)" in said, said


def test_a_full_model_sharded_or_pretrained_fills_the_buffers(saved, tmp_path):
    """A full-model file does not say which tensors are buffers: `shard` stores them all as
    parameters, and loading by name puts each back where the model has it."""
    full = str(tmp_path / "model.safetensors")
    consolidate(saved["ckpt"], full)
    assert load_file(full)["freqs_cis"].dtype == torch.complex64
    shard(full, str(tmp_path / "sharded"), 3)
    from_shard = run_ranks(load, 2, timeout=120, ckpt=str(tmp_path / "sharded"))[0]
    pretrained = run_ranks(load, 2, timeout=120, ckpt=full, pretrained=True)[0]
    for result in (from_shard, pretrained):
        assert result["error"] is None, result["error"]
        for name in ("scale", "seen", "freqs_cis", "lin.weight"):
            assert torch.equal(result["after"][name], saved["state"][name]), name
    dropped = {"scale": ((4,), torch.float32), "seen": ((), torch.int64), "extra": ((2,), torch.float32)}
    result = run_ranks(load, 2, timeout=120, ckpt=full, pretrained=True, buffers=dropped)[0]
    assert "missing from the checkpoint: extra" in result["error"] and "not in the model: freqs_cis" in result["error"]


def test_a_trained_parameter_does_not_load_into_a_buffer(saved):
    """Its optimizer state would be dropped: refused under strict, as a difference of role."""
    result = run_ranks(load_bias_buffer, 2, timeout=120, ckpt=saved["ckpt"])[0]
    assert "saved in another role: lin.bias (a trained parameter in the checkpoint" in result, result


def load_bias_buffer(rank: int, world: int, ckpt: str) -> str:
    model = WithBuffers()
    bias = model.lin.bias.detach().clone()
    del model.lin.bias
    model.lin.register_buffer("bias", bias)  # the same name, now a buffer
    engine = _engine(model)
    try:
        engine.load_checkpoint(ckpt)
    except zeroshard.ZeroshardError as exc:
        return str(exc)
    return "loaded"
