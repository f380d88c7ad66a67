"""`shard` into many small rank files takes the packed path (toolkit/shard_packed.py, issue 55):
the files are byte for byte those the rank-by-rank writer makes, from one model file or several."""

import json
import uuid

import pytest
import torch
from safetensors.torch import load_file, save_file

from zeroshard.toolkit import shard_packed
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.shard import shard
from zeroshard.toolkit.verify import verify

from checkpoints import odd_model, save_model

TIER = "default"  # docs/TESTING.md

WORLD = 70  # past packed.PACK_MIN_FILES: many files, each small
FITS = shard_packed.fits


def sharded(src, out, monkeypatch, packed: bool) -> dict[str, bytes]:
    """Every file `shard` writes (the checkpoint id fixed, so two runs can be compared)."""
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=7))
    calls = []
    monkeypatch.setattr(shard_packed, "fits", lambda *a: calls.append(FITS(*a)) or (packed and calls[-1]))
    shard(str(src), str(out), WORLD)
    assert calls == [True]  # the packed path was open to this job; `packed` says whether it took it
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_packed_shard_writes_the_rank_by_rank_writers_bytes(tmp_path, monkeypatch):
    model = odd_model()
    model["wide.weight"] = torch.randn(300, 7)  # fragments of many ranks, and ranks without one
    save_model(model, tmp_path / "model.safetensors")
    slow = sharded(tmp_path / "model.safetensors", tmp_path / "slow", monkeypatch, packed=False)
    fast = sharded(tmp_path / "model.safetensors", tmp_path / "fast", monkeypatch, packed=True)
    ranks = [n for n in slow if n.startswith("rank-")]
    assert len(ranks) == WORLD and sorted(fast) == sorted(slow)
    for name in ranks:
        assert fast[name] == slow[name], name
    files = lambda m: json.loads(m)["files"]  # noqa: E731  (the manifest's entries: sizes and hashes)
    assert files(fast["zeroshard.json"]) == files(slow["zeroshard.json"])
    assert verify(str(tmp_path / "fast")).ok
    consolidate(str(tmp_path / "fast"), str(tmp_path / "back.safetensors"))
    back = load_file(tmp_path / "back.safetensors")
    assert sorted(back) == sorted(model)
    for name, tensor in model.items():
        assert torch.equal(back[name], tensor), name


def test_packed_shard_reads_a_model_split_over_files(tmp_path, monkeypatch):
    model = {f"layer.{i}.weight": torch.randn(97, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    folder = tmp_path / "hf"
    folder.mkdir()
    names = {}
    for part, keys in enumerate([["layer.0.weight", "layer.3.weight"], ["layer.1.weight", "layer.2.weight",
                                                                          "layer.4.weight", "layer.5.weight"]]):
        file = f"model-{part + 1:05d}-of-00002.safetensors"
        save_file({k: model[k] for k in keys}, str(folder / file))
        names.update({k: file for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    slow = sharded(folder, tmp_path / "slow", monkeypatch, packed=False)
    fast = sharded(folder, tmp_path / "fast", monkeypatch, packed=True)
    assert {n: b for n, b in fast.items() if n.startswith("rank-")} == \
        {n: b for n, b in slow.items() if n.startswith("rank-")}


@pytest.mark.parametrize("world", [8, 70])
def test_a_failed_packed_shard_leaves_no_checkpoint(tmp_path, monkeypatch, world):
    save_model(odd_model(), tmp_path / "model.safetensors")
    monkeypatch.setattr(shard_packed, "copy_pieces", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    if world < 64:  # too few files for the packed path: the general path, untouched
        shard(str(tmp_path / "model.safetensors"), str(tmp_path / "ck"), world)
        assert verify(str(tmp_path / "ck")).ok
        return
    with pytest.raises(OSError, match="No space left"):
        shard(str(tmp_path / "model.safetensors"), str(tmp_path / "ck"), world)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
