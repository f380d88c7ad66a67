"""Round trips are exact: shard -> consolidate, reshard N -> M -> N, HF layout, dtype casts."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zeroshard.format import HASH_TABLE_NAME, CheckpointReader, open_checkpoint, owned_range
from zeroshard.toolkit.consolidate import consolidate, parse_size, plan_shards
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.shard import shard
from zeroshard.toolkit.verify import verify

from checkpoints import odd_model, read_checkpoint, save_model, training_state, write_checkpoint

TIER = "default"  # docs/TESTING.md


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(-1).view(torch.uint8) if a[name].numel() else a[name],
                           b[name].view(-1).view(torch.uint8) if b[name].numel() else b[name]), name


@pytest.mark.parametrize("world", [1, 2, 3, 4, 16, 40])
def test_shard_then_consolidate_is_bit_exact(tmp_path, world):
    model = odd_model()
    save_model(model, tmp_path / "model.safetensors")
    shard(str(tmp_path / "model.safetensors"), str(tmp_path / "ckpt"), world)
    assert verify(str(tmp_path / "ckpt")).ok
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    assert_same(model, load_file(tmp_path / "out.safetensors"))


def test_every_dtype_of_the_format_round_trips_bit_exact(tmp_path):
    """Each dtype docs/FORMAT.md lists, through shard, reshard and consolidate; what plain
    safetensors reads back is the bytes that went in (complex and the 8-bit floats included)."""
    from zeroshard.storage.safetensors_header import DTYPE_SIZES, torch_dtype

    g = torch.Generator().manual_seed(0)
    model = {f"t_{name.lower()}": torch.randint(0, 256, (5 * 7 * DTYPE_SIZES[name],), dtype=torch.uint8,
                                                generator=g).view(torch_dtype(name)).reshape(5, 7)
             for name in DTYPE_SIZES if name != "BOOL"}
    model["t_bool"] = torch.rand(5, 7, generator=g) > 0.5
    save_model(model, tmp_path / "model.safetensors")
    shard(str(tmp_path / "model.safetensors"), str(tmp_path / "ckpt"), 3)
    reshard(str(tmp_path / "ckpt"), 4, str(tmp_path / "w4"))
    assert verify(str(tmp_path / "w4")).ok
    consolidate(str(tmp_path / "w4"), str(tmp_path / "out.safetensors"))
    assert_same(model, load_file(tmp_path / "out.safetensors"))


def test_rank_files_open_with_plain_safetensors(tmp_path):
    save_model(odd_model(), tmp_path / "m.safetensors")
    manifest = shard(str(tmp_path / "m.safetensors"), str(tmp_path / "ckpt"), 4)
    for file in manifest.files:
        with safe_open(str(tmp_path / "ckpt" / file.name), "pt") as f:
            meta = f.metadata()
            assert meta["format"] == "zeroshard-checkpoint" and meta["format_version"] == "1.1"
            assert meta["rank"] == str(file.rank) and meta["world_size"] == "4"
            assert meta["checkpoint_id"] == manifest.id
            keys = [k for k in f.keys() if k != HASH_TABLE_NAME]
            assert len(keys) == len(f.keys()) - 1
            for key in keys:
                start, end = owned_range(manifest.tensors[key], 4, file.rank)
                assert f.get_tensor(key).shape == (end - start,)
            assert f.get_tensor(HASH_TABLE_NAME).shape == (len(keys),)


@pytest.mark.parametrize("middle", [1, 2, 3, 5, 16])
def test_reshard_there_and_back_keeps_every_tensor(tmp_path, middle):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "w4"), specs, data, 4)
    original = read_checkpoint(str(tmp_path / "w4"))
    there = reshard(str(tmp_path / "w4"), middle, str(tmp_path / "mid"))
    assert verify(str(tmp_path / "mid")).ok
    assert there.manifest.world_size == middle
    reshard(str(tmp_path / "mid"), 4, str(tmp_path / "back"))
    assert verify(str(tmp_path / "back")).ok
    result = read_checkpoint(str(tmp_path / "back"))
    rng = [n for n in original if n.startswith("rng/")]
    assert len(rng) == 4 and sorted(there.dropped) == sorted(rng)  # per-rank items do not carry over
    assert_same({k: v for k, v in original.items() if k not in rng}, result)
    _, manifest = open_checkpoint(str(tmp_path / "back"))
    assert manifest.step == 7 and manifest.client_state == {"epoch": 1, "offset": 123}
    assert manifest.optimizer["class"] == "torch.optim.AdamW"
    assert manifest.extra["resharded_from"]["world_size"] == middle


def test_reshard_to_same_world_size_keeps_rank_local_state(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "a"), specs, data, 3)
    result = reshard(str(tmp_path / "a"), 3, str(tmp_path / "b"))
    assert result.dropped == []
    assert_same(read_checkpoint(str(tmp_path / "a")), read_checkpoint(str(tmp_path / "b")))


def test_reshard_output_is_what_a_native_save_would_be(tmp_path):
    """Resharded files hold exactly the canonical ranges: same bytes as writing at M directly."""
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "w4"), specs, data, 4, rng=False)
    write_checkpoint(str(tmp_path / "w6"), specs, data, 6, rng=False)
    reshard(str(tmp_path / "w4"), 6, str(tmp_path / "r6"))
    native_location, native = open_checkpoint(str(tmp_path / "w6"))
    resharded_location, resharded = open_checkpoint(str(tmp_path / "r6"))
    assert [(f.name, f.size) for f in native.files] == [(f.name, f.size) for f in resharded.files]
    assert list(native.tensors.values()) == list(resharded.tensors.values())
    with CheckpointReader(native_location, native) as a, CheckpointReader(resharded_location, resharded) as b:
        for t in native.tensors.values():
            for rank in range(6):
                if owned_range(t, 6, rank)[1] > owned_range(t, 6, rank)[0]:
                    assert a.fragment_hash(t.name, rank) == b.fragment_hash(t.name, rank)


def test_consolidate_writes_only_model_weights_and_tied_aliases(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 3, aliases={"lm_head.weight": "embed.weight"})
    consolidate(str(tmp_path / "c"), str(tmp_path / "m.safetensors"))
    out = load_file(tmp_path / "m.safetensors")
    expected = {k: v for k, v in data.items() if not k.startswith(("optimizer/", "rng/"))}
    expected["lm_head.weight"] = data["embed.weight"]
    assert_same(expected, out)


@pytest.mark.parametrize("dtype,torch_dtype",
                         [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_consolidate_dtype_cast_matches_torch(tmp_path, dtype, torch_dtype):
    model = odd_model()
    save_model(model, tmp_path / "m.safetensors")
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "ckpt"), 3)
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "o.safetensors"), dtype=dtype)
    out = load_file(tmp_path / "o.safetensors")
    expected = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in model.items()}
    assert_same(expected, out)


def test_consolidate_hf_layout_with_index(tmp_path):
    model = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(10)}  # 16 KiB each
    save_model(model, tmp_path / "m.safetensors")
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "ckpt"), 4)
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_size="40KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)]
    assert index["metadata"]["total_size"] == 10 * 64 * 64 * 4
    merged = {}
    for name in files:
        part = load_file(tmp_path / "hf" / name)
        assert all(index["weight_map"][k] == name for k in part)
        merged.update(part)
    assert_same(model, merged)
    # an HF folder is itself a valid source for shard: round trip through it
    shard(str(tmp_path / "hf"), str(tmp_path / "ckpt2"), 2)
    consolidate(str(tmp_path / "ckpt2"), str(tmp_path / "again.safetensors"))
    assert_same(model, load_file(tmp_path / "again.safetensors"))


def test_consolidate_overwrite_of_hf_folder_removes_stale_shards(tmp_path):
    model = {f"w{i}": torch.randn(32, 32) for i in range(6)}
    save_model(model, tmp_path / "m.safetensors")
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "ckpt"), 2)
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_size="5KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) == 6
    consolidate(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_size="1GB", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    assert_same(model, load_file(tmp_path / "hf" / "model.safetensors"))


def test_parse_size_and_plan():
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500_000_000
    assert parse_size("123") == 123
    with pytest.raises(Exception):
        parse_size("lots")
    assert plan_shards([], 10) == [[]]


def test_latest_pointer_is_followed(tmp_path):
    from zeroshard.format import update_latest
    from zeroshard.storage import Location

    save_model(odd_model(), tmp_path / "m.safetensors")
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "root" / "step-1"), 2)
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "root" / "step-2"), 3)
    update_latest(Location(str(tmp_path / "root")), "step-2")
    location, manifest = open_checkpoint(str(tmp_path / "root"))
    assert location.url.endswith("step-2") and manifest.world_size == 3


def test_reshard_of_a_root_writes_a_root(tmp_path):
    from zeroshard.format import update_latest
    from zeroshard.storage import Location

    specs, data = training_state()
    write_checkpoint(str(tmp_path / "run" / "step-5"), specs, data, 4)
    update_latest(Location(str(tmp_path / "run")), "step-5")
    result = reshard(str(tmp_path / "run"), 2, str(tmp_path / "run2"))
    assert result.location.url.endswith("run2/step-5")
    assert (tmp_path / "run2" / "latest").read_text().strip() == "step-5"
    location, manifest = open_checkpoint(str(tmp_path / "run2"))
    assert manifest.world_size == 2 and location.url.endswith("step-5")


def test_many_small_chunks_through_the_write_behind_pipeline(tmp_path, monkeypatch):
    """Tensors spanning many copy chunks, with writes overlapping the next reads: still exact."""
    import zeroshard.format.reader as reader_module

    monkeypatch.setattr(reader_module, "DEFAULT_CHUNK_BYTES", 96)  # not a multiple of every itemsize
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "w3"), specs, data, 3)
    reshard(str(tmp_path / "w3"), 5, str(tmp_path / "w5"))
    reshard(str(tmp_path / "w5"), 3, str(tmp_path / "back"))
    original = {k: v for k, v in read_checkpoint(str(tmp_path / "w3")).items() if not k.startswith("rng/")}
    assert_same(original, read_checkpoint(str(tmp_path / "back")))
    consolidate(str(tmp_path / "w5"), str(tmp_path / "m.safetensors"))
    assert_same({k: v for k, v in original.items() if not k.startswith("optimizer/")},
                load_file(tmp_path / "m.safetensors"))
    model = odd_model()
    save_model(model, tmp_path / "odd.safetensors")
    shard(str(tmp_path / "odd.safetensors"), str(tmp_path / "odd"), 4)
    consolidate(str(tmp_path / "odd"), str(tmp_path / "odd2.safetensors"), dtype="bf16")
    assert_same({k: v.bfloat16() if v.is_floating_point() else v for k, v in model.items()},
                load_file(tmp_path / "odd2.safetensors"))
