"""Format 1.1 keeps the manifest O(tensors + ranks), and 1.0 checkpoints (shipped, written by the
1.0 writer) stay readable: reshard and consolidate of a 1.0 checkpoint write 1.1."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from zeroshard.format import open_checkpoint
from zeroshard.format.writer import TensorSpec
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.inspect import inspect_checkpoint
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.verify import verify

from checkpoints import read_checkpoint, training_state, write_checkpoint
from test_roundtrip import assert_same

TIER = "default"  # docs/TESTING.md

FORMAT_1_0 = Path(__file__).parent / "data" / "format-1.0"


def test_shipped_1_0_checkpoints_verify_and_read():
    for name in ("odd-w4", "training-w3"):
        report = verify(str(FORMAT_1_0 / name))
        assert report.ok, report.problems
        assert inspect_checkpoint(str(FORMAT_1_0 / name))["format_version"] == "1.0"


@pytest.mark.parametrize("world", [1, 3, 4, 7])
def test_1_0_consolidate_and_reshard_write_1_1(tmp_path, world):
    model = load_file(FORMAT_1_0 / "odd-model.safetensors")
    consolidate(str(FORMAT_1_0 / "odd-w4"), str(tmp_path / "m.safetensors"))
    assert_same(model, load_file(tmp_path / "m.safetensors"))
    reshard(str(FORMAT_1_0 / "odd-w4"), world, str(tmp_path / "r"))
    _, manifest = open_checkpoint(str(tmp_path / "r"))
    assert manifest.version == "1.1" and manifest.world_size == world
    assert verify(str(tmp_path / "r")).ok
    consolidate(str(tmp_path / "r"), str(tmp_path / "back.safetensors"))
    assert_same(model, load_file(tmp_path / "back.safetensors"))


def test_1_0_training_checkpoint_reshards_with_its_optimizer_state(tmp_path):
    original = read_checkpoint(str(FORMAT_1_0 / "training-w3"))
    reshard(str(FORMAT_1_0 / "training-w3"), 3, str(tmp_path / "same"))
    assert_same(original, read_checkpoint(str(tmp_path / "same")))  # same world size: RNG states carry
    reshard(str(FORMAT_1_0 / "training-w3"), 5, str(tmp_path / "five"))
    assert_same({k: v for k, v in original.items() if not k.startswith("rng/")},
                read_checkpoint(str(tmp_path / "five")))
    _, manifest = open_checkpoint(str(tmp_path / "five"))
    assert manifest.aliases == {"lm_head.weight": "embed.weight"} and manifest.step == 7


def test_1_0_rank_file_swapped_into_a_1_1_checkpoint_is_refused(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 3)
    shutil.copy(FORMAT_1_0 / "training-w3" / "rank-00001-of-00003.safetensors", tmp_path / "c")
    report = verify(str(tmp_path / "c"))
    assert not report.ok and "rank-00001-of-00003.safetensors" in report.problems[0]


def manifest_bytes(path: Path) -> int:
    return (path / "zeroshard.json").stat().st_size


def test_manifest_grows_with_tensors_plus_ranks_not_their_product(tmp_path):
    """Doubling the world size adds a line per rank, whatever the tensor count."""
    import torch

    def make(tensors: int, world: int) -> int:
        specs = [TensorSpec(f"layer.{i}.weight", "param", "F32", (64,)) for i in range(tensors)]
        data = {s.name: torch.zeros(64) for s in specs}
        url = tmp_path / f"t{tensors}-w{world}"
        write_checkpoint(str(url), specs, data, world, rng=False, optimizer=None)
        return manifest_bytes(url)

    base = make(50, 8)
    more_ranks = make(50, 32) - base        # +24 file lines
    more_tensors = make(100, 8) - base      # +50 tensor lines
    both = make(100, 32) - base
    assert both == pytest.approx(more_ranks + more_tensors, abs=64)  # additive: no tensors x ranks term
    assert more_ranks < 24 * 120 and more_tensors < 50 * 120      # about one short line each


def test_manifest_has_no_fragment_lists(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 4)
    doc = json.loads((tmp_path / "c" / "zeroshard.json").read_text())
    assert doc["version"] == "1.1"
    assert not any("fragments" in t for t in doc["tensors"].values())
    assert doc["tensors"]["rng/rank-00002/cpu"]["owner"] == 2


def test_a_1_0_checkpoint_relabelled_1_1_is_refused_by_the_reader_naming_the_file(tmp_path):
    """What every reader (consolidate, reshard, an engine's load) sees: the first rank file it
    opens named, and why, in one line; not a missing tensor called 'None'."""
    from zeroshard.errors import CheckpointError
    from zeroshard.format import CheckpointReader

    shutil.copytree(FORMAT_1_0 / "training-w3", tmp_path / "c")
    doc = json.loads((tmp_path / "c" / "zeroshard.json").read_text())
    doc["version"] = "1.1"
    for t in doc["tensors"].values():
        fragments = t.pop("fragments")
        if t["layout"] == "local":
            t["owner"] = fragments[0][0]
    (tmp_path / "c" / "zeroshard.json").write_text(json.dumps(doc))
    location, manifest = open_checkpoint(str(tmp_path / "c"))
    with CheckpointReader(location, manifest) as reader:
        with pytest.raises(CheckpointError) as caught:
            reader.open_file(2)
    assert caught.value.where.endswith("rank-00002-of-00003.safetensors")
    assert caught.value.problem == ("no fragment hash table '__zeroshard_fragment_hashes__' in its header (written "
                                    "by format 1.0; its header says format '1.0') but the manifest says format 1.1")
