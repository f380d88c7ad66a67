"""consolidate --include/--exclude/--strip-prefix/--config (issue 19): the tensors chosen by the
same rules as load_state_dict, written bit-identical to an unfiltered export; mistakes are one
line and write nothing. Also: a save onto a committed tag says what to do instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import zeroshard
from zeroshard.cli import main
from zeroshard.format import TensorSpec
from zeroshard.storage import dtype_name

from checkpoints import odd_model, write_checkpoint
from distributed import run_ranks

TIER = "default"  # docs/TESTING.md

PREFIXED = {"module.embed.weight", "module.block.0.attn.weight", "module.block.0.attn.bias",
            "module.block.0.norm.scale", "module.head.weight", "_orig_mod.block.0.tiny"}


def make_checkpoint(folder: Path, names: dict[str, str] | None = None, **fields) -> dict[str, torch.Tensor]:
    """A 3-rank checkpoint of odd_model's tensors (renamed by `names`); returns them by stored name."""
    names = names or {}
    data = {names.get(k, k): v for k, v in odd_model(3).items()}
    specs = [TensorSpec(n, "param" if v.is_floating_point() else "buffer", dtype_name(v.dtype), tuple(v.shape),
                        "flat" if v.dim() and v.is_floating_point() else "whole") for n, v in data.items()]
    write_checkpoint(str(folder), specs, data, 3, **fields)
    return data


def prefixed(folder: Path) -> dict[str, torch.Tensor]:
    renames = {}
    for name in PREFIXED:
        bare = name.split(".", 1)[1]
        renames[bare] = name
    return make_checkpoint(folder, renames)


def cli(*args: str):
    return CliRunner().invoke(main, ["consolidate", "-q", *args])


def read_file(path: Path) -> dict[str, bytes]:
    """Every tensor of a safetensors file as its raw bytes (bit-exact comparisons), plus dtype/shape."""
    out = {}
    with safe_open(str(path), "pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            out[key] = (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                        if t.numel() else b"")
    return out


def read_folder(folder: Path) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for file in sorted(folder.glob("model*.safetensors")):
        part = read_file(file)
        assert not set(part) & set(out)
        out.update(part)
    return out


def assert_one_line_error(result, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for needle in needles:
        assert needle in result.output, result.output


# ---- selection -------------------------------------------------------------------------------------
def test_include_and_exclude_choose_tensors_bit_identical_to_the_full_export(tmp_path):
    stored = make_checkpoint(tmp_path / "c")
    assert cli(str(tmp_path / "c"), str(tmp_path / "all.safetensors")).exit_code == 0
    full = read_file(tmp_path / "all.safetensors")
    assert set(full) == set(stored)
    result = cli("--include", "block.*", "--include", "head.*", "--exclude", "*.bias", "--exclude", "*.count",
                 str(tmp_path / "c"), str(tmp_path / "some.safetensors"))
    assert result.exit_code == 0, result.output
    some = read_file(tmp_path / "some.safetensors")
    assert set(some) == {"block.0.attn.weight", "block.0.norm.scale", "block.0.flag", "block.0.tiny", "head.weight"}
    assert all(some[k] == full[k] for k in some)
    # the same choice as load_state_dict's names=/exclude=
    loaded = zeroshard.load_state_dict(str(tmp_path / "c"), ["block.*", "head.*"], exclude=["*.bias", "*.count"])
    assert set(loaded) == set(some)


def test_a_sharded_folder_holds_only_the_chosen_tensors_and_its_index_says_so(tmp_path):
    make_checkpoint(tmp_path / "c")
    assert cli(str(tmp_path / "c"), str(tmp_path / "all.safetensors")).exit_code == 0
    full = read_file(tmp_path / "all.safetensors")
    result = cli("--exclude", "embed.*", "--max-shard-size", "300B", str(tmp_path / "c"), str(tmp_path / "hf"))
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(files) > 1
    got = read_folder(tmp_path / "hf")
    assert set(got) == set(full) - {"embed.weight"}
    assert all(got[k] == full[k] for k in got)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(len(v[2]) for v in got.values())


def test_strip_prefix_renames_like_load_state_dict(tmp_path):
    stored = prefixed(tmp_path / "c")
    assert cli(str(tmp_path / "c"), str(tmp_path / "all.safetensors")).exit_code == 0
    full = read_file(tmp_path / "all.safetensors")
    result = cli("--strip-prefix", "module.", "--strip-prefix", "_orig_mod.", str(tmp_path / "c"),
                 str(tmp_path / "bare.safetensors"))
    assert result.exit_code == 0, result.output
    bare = read_file(tmp_path / "bare.safetensors")
    expected = {n.split(".", 1)[1] if n in PREFIXED else n: n for n in stored}
    assert set(bare) == set(expected)
    assert all(bare[new] == full[old] for new, old in expected.items())
    loaded = zeroshard.load_state_dict(str(tmp_path / "c"), strip_prefix=["module.", "_orig_mod."])
    assert set(loaded) == set(bare)


def test_include_with_strip_prefix_matches_the_stored_names(tmp_path):
    prefixed(tmp_path / "c")
    result = cli("--include", "module.block.*", "--strip-prefix", "module.", str(tmp_path / "c"),
                 str(tmp_path / "o.safetensors"))
    assert result.exit_code == 0, result.output
    assert set(read_file(tmp_path / "o.safetensors")) == {"block.0.attn.weight", "block.0.attn.bias",
                                                          "block.0.norm.scale"}


# ---- mistakes: one line, nothing written -------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--include", "--exclude"])
def test_a_glob_matching_nothing_is_an_error_naming_it(tmp_path, flag):
    make_checkpoint(tmp_path / "c")
    result = cli(flag, "block.*", flag, "decoder.*", str(tmp_path / "c"), str(tmp_path / "hf"))
    assert_one_line_error(result, flag, "'decoder.*'", "matches no tensor")
    assert not (tmp_path / "hf").exists()


def test_excluding_everything_is_an_error(tmp_path):
    make_checkpoint(tmp_path / "c")
    result = cli("--exclude", "*", str(tmp_path / "c"), str(tmp_path / "o.safetensors"))
    assert_one_line_error(result, "no tensor to write")
    assert not (tmp_path / "o.safetensors").exists()


def test_a_collision_after_stripping_names_both_tensors(tmp_path):
    make_checkpoint(tmp_path / "c", {"block.0.tiny": "module.embed.weight"})  # and embed.weight stays
    result = cli("--strip-prefix", "module.", str(tmp_path / "c"), str(tmp_path / "o.safetensors"))
    assert_one_line_error(result, "'embed.weight'", "'module.embed.weight'", "--strip-prefix")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_an_existing_output_is_untouched_by_a_refused_filter(tmp_path):
    make_checkpoint(tmp_path / "c")
    assert cli(str(tmp_path / "c"), str(tmp_path / "hf")).exit_code == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    result = cli("--overwrite", "--include", "nothing.*", str(tmp_path / "c"), str(tmp_path / "hf"))
    assert_one_line_error(result, "'nothing.*'")
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before


# ---- config.json -------------------------------------------------------------------------------------
def test_config_is_copied_into_the_folder_byte_for_byte(tmp_path):
    make_checkpoint(tmp_path / "c")
    config = tmp_path / "my-config.json"
    config.write_bytes(b'{"model_type": "llama", "hidden_size": 11}\n')
    result = cli("--config", str(config), str(tmp_path / "c"), str(tmp_path / "hf"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "config.json").read_bytes() == config.read_bytes()
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_bad_config_uses_are_refused_before_writing(tmp_path):
    make_checkpoint(tmp_path / "c")
    good, bad, listed = tmp_path / "good.json", tmp_path / "bad.json", tmp_path / "list.json"
    good.write_text('{"model_type": "gpt2"}')
    bad.write_text('{"model_type": ')
    listed.write_text("[1, 2]")
    cases = [(["--config", str(good), str(tmp_path / "c"), str(tmp_path / "o.safetensors")], "give a folder"),
             (["--config", str(bad), str(tmp_path / "c"), str(tmp_path / "hf")], "not valid JSON"),
             (["--config", str(listed), str(tmp_path / "c"), str(tmp_path / "hf")], "JSON object"),
             (["--config", str(tmp_path / "missing.json"), str(tmp_path / "c"), str(tmp_path / "hf")], "cannot read")]
    for args, needle in cases:
        assert_one_line_error(cli(*args), needle)
    assert not (tmp_path / "o.safetensors").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("where", ["extra", "client_state"])
def test_the_model_config_a_checkpoint_carries_goes_along_and_config_overrides_it(tmp_path, where):
    carried = {"model_type": "llama", "hidden_size": 11, "num_hidden_layers": 1}
    if where == "extra":
        make_checkpoint(tmp_path / "c", extra={"model_config": carried})
    else:  # as `save_checkpoint(root, client_state={"model_config": model.config.to_dict()})` records it
        make_checkpoint(tmp_path / "c")
        manifest = json.loads((tmp_path / "c" / "zeroshard.json").read_text())
        manifest["client_state"] = {"epoch": 1, "model_config": carried}
        (tmp_path / "c" / "zeroshard.json").write_text(json.dumps(manifest))
    assert cli(str(tmp_path / "c"), str(tmp_path / "hf")).exit_code == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == carried
    assert cli(str(tmp_path / "c"), str(tmp_path / "one.safetensors")).exit_code == 0  # no place for it: fine
    mine = tmp_path / "mine.json"
    mine.write_text('{"model_type": "mistral"}')
    assert cli("--overwrite", "--config", str(mine), str(tmp_path / "c"), str(tmp_path / "hf")).exit_code == 0
    assert (tmp_path / "hf" / "config.json").read_bytes() == mine.read_bytes()
    make_checkpoint(tmp_path / "plain")  # none carried, none given: no config.json
    assert cli(str(tmp_path / "plain"), str(tmp_path / "hf2")).exit_code == 0
    assert not (tmp_path / "hf2" / "config.json").exists()


@pytest.mark.s3
def test_an_s3_folder_gets_the_chosen_tensors_and_config_streamed(tmp_path, s3_bucket):
    from zeroshard.storage import Location

    make_checkpoint(tmp_path / "c", extra={"model_config": {"model_type": "gpt2"}})
    assert cli("--max-shard-size", "300B", str(tmp_path / "c"), str(tmp_path / "local")).exit_code == 0
    result = cli("--max-shard-size", "300B", "--exclude", "head.*", str(tmp_path / "c"), f"{s3_bucket}/hf")
    assert result.exit_code == 0, result.output
    remote = Location(f"{s3_bucket}/hf")
    index = json.loads(remote.read_bytes("model.safetensors.index.json"))
    full = read_folder(tmp_path / "local")
    got: dict[str, bytes] = {}
    for name in sorted(set(index["weight_map"].values())):
        (tmp_path / name).write_bytes(remote.read_bytes(name))
        got.update(read_file(tmp_path / name))
    assert set(got) == set(full) - {"head.weight"} and all(got[k] == full[k] for k in got)
    assert remote.read_bytes("config.json") == (tmp_path / "local" / "config.json").read_bytes()


# ---- torchrun mode -------------------------------------------------------------------------------------
def _distributed(rank: int, world: int, ckpt: str, out: str, config: str) -> list[str]:
    from zeroshard.toolkit.distributed import consolidate_distributed

    return consolidate_distributed(ckpt, out, max_shard_size="300B", include=["block.*", "module.*"],
                                   exclude=["*.bias"], strip_prefix=["module."], config=config)


def test_the_options_work_under_torchrun_mode(tmp_path):
    prefixed(tmp_path / "c")
    config = tmp_path / "cfg.json"
    config.write_text('{"model_type": "llama"}')
    single = cli("--include", "block.*", "--include", "module.*", "--exclude", "*.bias", "--strip-prefix", "module.",
                 "--max-shard-size", "300B", "--config", str(config), str(tmp_path / "c"), str(tmp_path / "one"))
    assert single.exit_code == 0, single.output
    files = run_ranks(_distributed, 2, timeout=180, ckpt=str(tmp_path / "c"), out=str(tmp_path / "two"),
                      config=str(config))
    assert files[0] == files[1] and files[0][-1].endswith("config.json")
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted(p.name for p in (tmp_path / "one").iterdir())
    for p in (tmp_path / "one").iterdir():
        assert (tmp_path / "two" / p.name).read_bytes() == p.read_bytes(), p.name
    assert "embed.weight" in read_folder(tmp_path / "two")


# ---- a second save onto a committed tag -------------------------------------------------------------------
def test_a_save_onto_a_committed_tag_says_what_to_do(tmp_path):
    from zeroshard.checkpointing.save import claim_tag
    from zeroshard.errors import CheckpointSaveError
    from zeroshard.storage import Location

    (tmp_path / "run" / "step-00000001").mkdir(parents=True)
    (tmp_path / "run" / "step-00000001" / "zeroshard.json").write_text("{}")
    with pytest.raises(CheckpointSaveError) as caught:
        claim_tag(Location(str(tmp_path / "run")), "step-00000001")
    message = str(caught.value)
    assert "step-00000001" in message and "exists" in message and "\n" not in message
    assert "tag=" in message and "new root" in message
    assert sorted(p.name for p in (tmp_path / "run" / "step-00000001").iterdir()) == ["zeroshard.json"]

