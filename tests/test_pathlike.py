"""Every public entry point that takes a path accepts `pathlib.Path` (any os.PathLike), not only str.

The entry points, each exercised below with a Path and nothing else:
  training (one gloo rank):  zeroshard.initialize(config=Path), engine.save_checkpoint / load_checkpoint /
                             load_pretrained, Checkpointer.save / load / load_pretrained,
                             zeroshard.deepspeed.initialize(config=Path), DeepSpeedEngine.save_checkpoint /
                             load_checkpoint (with and without tag)
  toolkit:                   shard, reshard, consolidate, inspect_checkpoint, verify, sign, clean,
                             reshard_distributed, consolidate_distributed
  interop:                   read_deepspeed, write_imported, export_state_dict, export_dcp, read_dcp,
                             load_metadata
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

TIER = "default"  # docs/TESTING.md

FIXTURES = Path(__file__).parent / "data" / "deepspeed"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _train(engine, seed: int = 0) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _training_entry_points(rank: int, world_size: int, root: str) -> dict[str, object]:
    from safetensors.torch import save_file

    import zeroshard
    import zeroshard.deepspeed as deepspeed

    base = Path(root)
    config = base / "zs.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    model = _model()
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    assert engine.stage == 2
    _train(engine)
    saved = engine.save_checkpoint(base / "native", client_state={"k": 1})
    assert isinstance(saved, str)
    assert engine.load_checkpoint(base / "native") == {"k": 1}
    save_file({k: v.contiguous() for k, v in _model().state_dict().items()}, str(base / "full.safetensors"))
    engine.load_pretrained(base / "full.safetensors")

    ckpt = zeroshard.Checkpointer(engine)
    ckpt.save(base / "ckpter", client_state={"c": 2})
    assert ckpt.load(base / "ckpter") == {"c": 2}
    ckpt.load_pretrained(base / "full.safetensors")

    ds_config = base / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 5, "zero_optimization": {"stage": 1},
                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}))
    ds, _, _, _ = deepspeed.initialize(model=_model(), config=ds_config)
    _train(ds)
    assert ds.save_checkpoint(base / "ds", client_state={"d": 3}) is True
    path, client = ds.load_checkpoint(base / "ds")
    tagged, client_tagged = ds.load_checkpoint(base / "ds", tag="global_step1")
    return {"client": client, "client_tagged": client_tagged, "path": str(path), "tagged": str(tagged)}


def test_training_entry_points_take_paths(tmp_path):
    out = run_ranks(_training_entry_points, 1, root=str(tmp_path), timeout=240)[0]
    assert out["client"] == {"d": 3} and out["client_tagged"] == {"d": 3}
    assert Path(out["tagged"]) == tmp_path / "ds" / "global_step1"
    assert (tmp_path / "native" / "latest").is_file() and (tmp_path / "ckpter" / "latest").is_file()


@pytest.fixture(scope="module")
def full_model(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("full") / "model.safetensors"
    save_file({"a.weight": torch.randn(6, 5), "b.bias": torch.randn(7)}, str(path))
    return path


def test_toolkit_entry_points_take_paths(tmp_path, full_model):
    from zeroshard.toolkit.clean import clean
    from zeroshard.toolkit.consolidate import consolidate
    from zeroshard.toolkit.inspect import inspect_checkpoint
    from zeroshard.toolkit.reshard import reshard
    from zeroshard.toolkit.shard import shard
    from zeroshard.toolkit.sign import sign
    from zeroshard.toolkit.verify import verify

    sharded = tmp_path / "sharded"
    assert shard(full_model, sharded, 2).world_size == 2
    assert inspect_checkpoint(sharded)["world_size"] == 2
    assert verify(sharded).ok
    resharded = reshard(sharded, 3, tmp_path / "three")
    assert inspect_checkpoint(tmp_path / "three")["world_size"] == 3, resharded
    assert reshard(sharded, 1) is not None  # the default output is derived from the Path
    assert (tmp_path / "sharded-world1" / "zeroshard.json").is_file()
    files = consolidate(tmp_path / "three", tmp_path / "out.safetensors")
    assert files and Path(files[0]).name == "out.safetensors"
    assert Path(sign(sharded, b"k" * 32)).name
    assert verify(sharded, key=b"k" * 32).ok
    assert not clean(tmp_path).stale


def _distributed_toolkit(rank: int, world_size: int, src: str, out: str) -> list[str]:
    from zeroshard.toolkit.distributed import consolidate_distributed, reshard_distributed

    url = reshard_distributed(Path(src), 2, Path(out) / "two")
    dist.barrier()
    return [url, *consolidate_distributed(Path(out) / "two", Path(out) / "model.safetensors")]


def test_distributed_toolkit_entry_points_take_paths(tmp_path, full_model):
    from zeroshard.toolkit.shard import shard

    shard(str(full_model), str(tmp_path / "src"), 1)
    urls = run_ranks(_distributed_toolkit, 2, src=str(tmp_path / "src"), out=str(tmp_path), timeout=240)[0]
    assert (tmp_path / "two" / "zeroshard.json").is_file() and (tmp_path / "model.safetensors").is_file(), urls


def test_interop_entry_points_take_paths(tmp_path):
    from zeroshard.interop.dcp_export import export_dcp, export_state_dict
    from zeroshard.interop.dcp_import import read_dcp
    from zeroshard.interop.dcp_metadata import load_metadata
    from zeroshard.interop.deepspeed_ckpt import read_deepspeed
    from zeroshard.interop.write import write_imported

    imported = read_deepspeed(FIXTURES / "stage2")
    manifest = write_imported(imported, tmp_path / "zs", source=FIXTURES / "stage2")
    assert manifest.world_size == 2
    assert export_state_dict(tmp_path / "zs")["model"]
    assert export_dcp(tmp_path / "zs", tmp_path / "dcp") > 0
    assert load_metadata(tmp_path / "dcp" / ".metadata") is not None
    assert set(read_dcp(tmp_path / "dcp").params) == set(imported.params)
