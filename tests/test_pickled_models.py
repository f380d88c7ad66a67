"""Full models saved with torch.save (`pytorch_model.bin`, a training script's `ckpt.pt`,
DeepSpeed's `zero_to_fp32` output) are read by `shard` and `load_pretrained` through the closed
allowlist, by byte range, bit for bit; what is not one model is refused naming the file."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import zeroshard
from zeroshard.cli import main
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.shard import shard

from distributed import run_ranks
from interop_model import make_model

TIER = "mixed"  # docs/TESTING.md

FIXTURES = Path(__file__).parent / "data" / "deepspeed"


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def a_state_dict() -> dict[str, torch.Tensor]:
    """Tied weights (one storage, two names), a bf16 tensor, an int64 buffer, a scalar, an empty
    tensor and a view at an offset into a bigger storage: what real state dicts hold."""
    model = make_model(seed=3)
    state = model.state_dict()
    fused = torch.randn(6, 4)
    state |= {"half": torch.randn(3, 7).bfloat16(), "count": torch.tensor(7), "none": torch.empty(0, 3),
              "q": fused[2:4], "kv": fused[4:]}
    assert state["head.weight"].data_ptr() == state["emb.weight"].data_ptr()
    return state


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_a_state_dict_shards_and_consolidates_bit_exact(tmp_path):
    state = a_state_dict()
    torch.save(state, tmp_path / "model.pt")
    manifest = shard(str(tmp_path / "model.pt"), str(tmp_path / "ckpt"), 3)
    assert "source_notes" not in manifest.extra
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    assert_same(load_file(tmp_path / "out.safetensors"), state)


def test_a_training_scripts_dict_gives_its_model_and_names_what_was_left(tmp_path):
    state = a_state_dict()
    optimizer = torch.optim.AdamW(make_model().parameters())
    torch.save({"model": state, "optimizer": optimizer.state_dict(), "iter_num": 5, "config": {"n_layer": 2}},
               tmp_path / "ckpt.pt")  # nanoGPT's layout
    code, out, err = cli("shard", str(tmp_path / "ckpt.pt"), str(tmp_path / "ckpt"), "--world", "2", "-q")
    assert code == 0, err
    assert f"note: {tmp_path / 'ckpt.pt'}: took the {len(state)} tensors of entry 'model' as the model; left " \
           "beside it: 'optimizer', 'iter_num', 'config'" in out, out
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    assert_same(load_file(tmp_path / "out.safetensors"), state)


def test_an_hf_folder_of_pickles_and_its_index_shard_bit_exact(tmp_path):
    state = a_state_dict()
    hf = tmp_path / "hf"
    hf.mkdir()
    names = sorted(state)
    parts = {"pytorch_model-00001-of-00002.bin": names[:5], "pytorch_model-00002-of-00002.bin": names[5:]}
    for file, keys in parts.items():
        torch.save({k: state[k] for k in keys}, hf / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (hf / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    shard(str(hf), str(tmp_path / "ckpt"), 4)
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    assert_same(load_file(tmp_path / "out.safetensors"), state)
    # an index that disagrees with its files is refused, as for safetensors
    index["weight_map"][names[0]] = "pytorch_model-00002-of-00002.bin"
    (hf / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    code, _, err = cli("shard", str(hf), str(tmp_path / "bad"), "--world", "2", "-q")
    assert code == 1 and "the index and its files disagree" in err and not (tmp_path / "bad").exists(), err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("max_shard_size", ["5GB", "0.0002MB"])
def test_deepspeeds_zero_to_fp32_output_shards_bit_exact(tmp_path, max_shard_size):
    """DeepSpeed's own consolidation writes pickles by default (pytorch_model.bin, or shards and
    pytorch_model.bin.index.json): they shard to exactly the weights torch.load gives."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    out = tmp_path / "fp32"
    convert_zero_checkpoint_to_fp32_state_dict(str(FIXTURES / "stage3"), str(out), max_shard_size=max_shard_size)
    files = sorted(p.name for p in out.glob("*.bin"))
    assert (len(files) > 1) == (max_shard_size == "0.0002MB"), files
    want: dict[str, torch.Tensor] = {}
    for name in files:
        want |= torch.load(out / name, weights_only=True)
    assert "head.weight" in want and "emb.weight" in want  # the tied pair, under both names
    code, _, err = cli("shard", str(out), str(tmp_path / "ckpt"), "--world", "3", "-q")
    assert code == 0, err
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    assert_same(load_file(tmp_path / "out.safetensors"), want)


def pretrained(rank: int, world: int, path: str) -> dict:
    model = make_model(seed=9)
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                  config={"zero_optimization": {"stage": 3}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_pretrained(path)
    said = [str(w.message) for w in caught if "load_pretrained" in str(w.message)]
    return {"state": engine.full_state_dict(), "said": said}


def test_load_pretrained_reads_a_pickled_model_by_range(tmp_path):
    state = make_model(seed=4).state_dict()
    torch.save({"model": state, "step": 12}, tmp_path / "ckpt.pt")
    first, second = run_ranks(pretrained, 2, timeout=120, path=str(tmp_path / "ckpt.pt"))
    assert_same(first["state"], state)
    assert len(first["said"]) == 1 and "entry 'model'" in first["said"][0] and "'step'" in first["said"][0]
    assert second["said"] == []  # rank 0 says it once


def test_what_is_not_one_model_is_refused_naming_the_file(tmp_path):
    state = make_model().state_dict()
    side = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {side}",))

    cases = {
        "mixed.pt": (state | {"epoch": 3}, "holds tensors beside 'epoch' (int)"),
        "two.pt": ({"a": state, "b": state}, "holds several state dicts among its entries ('a', 'b')"),
        "none.pt": ({"optimizer": {"state": {}, "param_groups": []}}, "holds no state dict among its entries"),
        "list.pt": ([state], "holds a list, not a model's state dict"),
        "strided.pt": ({"w": torch.randn(4, 3).t()}, "non-contiguous view of shape [3, 4]"),
        "evil.pt": ({"w": torch.ones(2), "x": Evil()}, "refused to unpickle"),
    }
    for name, (value, problem) in cases.items():
        torch.save(value, tmp_path / name)
        code, _, err = cli("shard", str(tmp_path / name), str(tmp_path / "out"), "--world", "2", "-q")
        assert code == 1 and err.startswith(f"zeroshard: error: {tmp_path / name}: ") and problem in err, (name, err)
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    assert not side.exists()
    states = FIXTURES / "stage2" / "global_step3" / "mp_rank_00_model_states.pt"
    code, _, err = cli("shard", str(states), str(tmp_path / "out"), "--world", "2", "-q")
    assert code == 1 and "DeepSpeed model-states file" in err and "zeroshard import deepspeed" in err, err


@pytest.mark.s3
def test_a_pickled_model_on_s3_shards_to_s3(tmp_path, s3_bucket):
    state = a_state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    code, _, err = cli("shard", str(tmp_path / "pytorch_model.bin"), f"{s3_bucket}/local", "--world", "2", "-q")
    assert code == 0, err
    import fsspec

    fsspec.filesystem("s3").put(str(tmp_path / "pytorch_model.bin"), f"{s3_bucket}/hf/pytorch_model.bin")
    code, _, err = cli("shard", f"{s3_bucket}/hf", f"{s3_bucket}/ckpt", "--world", "3", "-q")
    assert code == 0, err
    for ckpt in ("local", "ckpt"):
        consolidate(f"{s3_bucket}/{ckpt}", str(tmp_path / f"{ckpt}.safetensors"))
        assert_same(load_file(tmp_path / f"{ckpt}.safetensors"), state)


def test_a_ddp_state_dict_sheds_its_prefix_and_load_pretrained_says_how(tmp_path):
    """`torch.save(ddp_model.state_dict())` names every tensor `module.*`: load_pretrained into the
    bare model names the prefix and both fixes: load_pretrained(strip_prefix=) reads it as it is,
    `shard --strip-prefix` writes a renamed copy."""
    state = make_model(seed=4).state_dict()
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "ddp.pt")
    error = run_ranks(pretrained_error, 2, timeout=120, path=str(tmp_path / "ddp.pt"))[0]
    assert "starts with 'module.'" in error and "--strip-prefix module." in error, error
    assert "strip_prefix='module.'" in error, error
    loaded = run_ranks(pretrained_stripped, 2, timeout=120, path=str(tmp_path / "ddp.pt"))[0]
    assert_same(loaded, state)
    code, _, err = cli("shard", str(tmp_path / "ddp.pt"), str(tmp_path / "ckpt"), "--world", "2",
                       "--strip-prefix", "module.", "-q")
    assert code == 0, err
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    assert_same(load_file(tmp_path / "out.safetensors"), state)
    torch.save({"module.w": torch.ones(2), "w": torch.zeros(2)}, tmp_path / "clash.pt")
    code, _, err = cli("shard", str(tmp_path / "clash.pt"), str(tmp_path / "clash"), "--world", "2",
                       "--strip-prefix", "module.", "-q")
    assert code == 1 and "makes 'module.w' and 'w' both 'w'" in err and not (tmp_path / "clash").exists(), err
    error = run_ranks(pretrained_error, 2, timeout=120, path=str(tmp_path / "clash.pt"), strip_prefix="module.")[0]
    assert "strip_prefix makes 'module.w' and 'w' both 'w'" in error, error


def pretrained_error(rank: int, world: int, path: str, strip_prefix: str | None = None) -> str | None:
    model = make_model(seed=9)
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                  config={"zero_optimization": {"stage": 3}})
    try:
        engine.load_pretrained(path, strip_prefix=strip_prefix)
    except zeroshard.ZeroshardError as exc:
        return str(exc)
    return None


def pretrained_stripped(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    """A stage-3 inference engine (a reference model) reads a DDP-prefixed pickle as it is."""
    engine = zeroshard.initialize(model=make_model(seed=9), optimizer=None, config={"zero_optimization": {"stage": 3}})
    engine.load_pretrained(path, strip_prefix="module.")
    return engine.full_state_dict()
