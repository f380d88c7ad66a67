"""`zeroshard import megatron` of a Megatron-Core 0.19.2 `torch_dist` checkpoint (tests/data/megatron,
written by megatron's own dist_checkpointing.save: tools/make_megatron_fixtures.py): a tiny
GPTModel at tensor parallel 2, layers stacked on a leading axis, split across the ranks as DCP
chunks. The import is compared bit for bit with the model's own state dict, gathered across the
tensor-parallel ranks by the script (reference.safetensors), without megatron installed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.interop import megatron
from zeroshard.interop.dcp_import import read_dcp
from zeroshard.interop.dcp_metadata import load_metadata
from zeroshard.interop.megatron import read_megatron

TIER = "default"

FIXTURE = Path(__file__).parent / "data" / "megatron"
CKPT = FIXTURE / "tp2"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
EXTRA_STATE = ["decoder.layers.self_attention.linear_proj._extra_state",
               "decoder.layers.self_attention.linear_qkv._extra_state",
               "decoder.layers.mlp.linear_fc1._extra_state", "decoder.layers.mlp.linear_fc2._extra_state"]


def _consolidated(tmp_path: Path, *flags: str) -> dict[str, torch.Tensor]:
    out, full = tmp_path / "imported", tmp_path / "full.safetensors"
    result = CliRunner().invoke(main, ["import", "megatron", str(CKPT), str(out), *flags])
    assert result.exit_code == 0, result.output
    assert f"step {EXPECTED['iteration']}, over 2 ranks" in result.output  # the iteration is the step
    result = CliRunner().invoke(main, ["consolidate", str(out), str(full)])
    assert result.exit_code == 0, result.output
    return load_file(str(full))


def test_metadata_with_save_plans_is_read():
    metadata = load_metadata(str(CKPT / ".metadata"))  # Megatron keeps every rank's SavePlan in it
    assert len(metadata.all_local_plans) == 2
    assert tuple(metadata.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"].size) == (2, 96, 32)


def test_split_layers_is_bit_exact(tmp_path):
    full, reference = _consolidated(tmp_path, "--split-layers"), load_file(str(FIXTURE / "reference.safetensors"))
    assert sorted(full) == sorted(reference)
    for name, value in reference.items():
        assert full[name].dtype == value.dtype and torch.equal(full[name], value), name


def test_layers_stay_stacked_by_default(tmp_path):
    full, reference = _consolidated(tmp_path), load_file(str(FIXTURE / "reference.safetensors"))
    layers = EXPECTED["layers"]
    stacked = [n for n in full if n.startswith("decoder.layers.")]
    assert stacked and all(full[n].shape[0] == layers for n in stacked)
    assert full["decoder.layers.self_attention.linear_qkv.weight"].shape == (layers, 96, 32)
    for name, value in full.items():
        if name in stacked:
            rest = name[len("decoder.layers."):]
            expected = torch.stack([reference[f"decoder.layers.{i}.{rest}"] for i in range(layers)])
        else:
            expected = reference[name]
        assert torch.equal(value, expected), name
    assert len(full) + len(stacked) * (layers - 1) == len(reference)


def test_notes_list_extra_state_and_iteration():
    imp = read_megatron(str(CKPT))
    assert imp.global_steps == EXPECTED["iteration"] and not imp.optimizer_state
    extra = next(n for n in imp.notes if "_extra_state" in n)
    assert all(f"{name} (x2)" in extra for name in EXTRA_STATE), extra
    assert any("kept as one tensor with a leading layer axis" in n for n in imp.notes)


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(CKPT, folder)
    return folder


def test_other_backend_refused_in_one_line(tmp_path):
    folder = _copy(tmp_path)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    with pytest.raises(CheckpointError) as err:
        read_megatron(str(folder))
    message = str(err.value)
    assert "\n" not in message and "metadata.json" in message and "'zarr'" in message and "torch_dist" in message
    result = CliRunner().invoke(main, ["import", "megatron", str(folder), str(tmp_path / "out")])
    assert result.exit_code != 0 and "'zarr'" in result.output and "Traceback" not in result.output


def test_missing_distcp_named_in_one_line(tmp_path):
    folder = _copy(tmp_path)
    (folder / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError) as err:
        read_megatron(str(folder))
    assert "\n" not in str(err.value) and "__1_0.distcp" in str(err.value)


def test_optimizer_state_refused_in_one_line(monkeypatch):
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"

    def with_optimizer(path: str):  # the fixture's metadata plus a distributed optimizer's entry
        metadata = load_metadata(path)
        metadata.state_dict_metadata[key] = metadata.state_dict_metadata["output_layer.weight"]
        return metadata

    monkeypatch.setattr(megatron, "load_metadata", with_optimizer)
    with pytest.raises(CheckpointError) as err:
        read_megatron(str(CKPT))
    assert "\n" not in str(err.value) and "distributed optimizer" in str(err.value) and key in str(err.value)


def test_import_dcp_points_to_import_megatron():
    with pytest.raises(CheckpointError, match="zeroshard import megatron"):
        read_dcp(str(CKPT))
