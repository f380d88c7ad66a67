"""DeepSpeed checkpoints written by older DeepSpeed releases themselves (tests/data/deepspeed_releases,
tools/make_deepspeed_release_fixtures.py: 0.14.5 on torch 2.4.1, 0.16.9 on torch 2.6.0, each in a
venv of its own): `zeroshard import deepspeed` holds DeepSpeed's own `zero_to_fp32` weights bit
for bit, and the resume continues with the losses of DeepSpeed's own resume. Users migrate with
the checkpoints their DeepSpeed wrote, rarely the newest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_import_deepspeed import _import, _resume

from zeroshard.format import open_checkpoint

from distributed import run_ranks
from interop_model import FROZEN

TIER = "default"  # docs/TESTING.md

RELEASES = Path(__file__).parent / "data" / "deepspeed_releases"
CASES = sorted((release.name, variant.name) for release in RELEASES.iterdir() if release.is_dir()
               for variant in release.iterdir() if (variant / "expected.json").exists())


def test_every_release_folder_holds_its_variants():
    assert {r for r, _ in CASES} == {"deepspeed-0.14.5", "deepspeed-0.16.9"}
    for release in {r for r, _ in CASES}:
        assert {"stage1", "stage2", "stage3", "bf16_stage3"} <= {v for r, v in CASES if r == release}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("release", "variant"), CASES)
def test_an_older_deepspeeds_checkpoint_imports_exactly_and_resumes_with_its_losses(tmp_path, release, variant):
    folder = RELEASES / release / variant
    expected = json.loads((folder / "expected.json").read_text())
    assert release == f"deepspeed-{expected['deepspeed_version']}"  # written by that release itself
    out = tmp_path / "imported"
    _import(folder, out)
    _, manifest = open_checkpoint(str(out))
    assert manifest.step == 3 and manifest.aliases == {"head.weight": "emb.weight"}
    notes = " ".join(manifest.extra["import_notes"])
    # `--deepspeed_config ds_config.json`: this release saved the file's path as ds_config
    assert ("the path DeepSpeed read its config from" in notes) == (variant == "config_file"), notes
    assert manifest.dtypes["compute"] == ("BF16" if variant.startswith("bf16") else "F32")
    # these releases did not clip by default (0.0 before 0.19.3); zeroshard.deepspeed clips at 1.0
    assert expected["gradient_clipping"] == 0.0 and "that run did not clip gradients" in notes, notes
    if (folder / "expected.safetensors").exists():  # DeepSpeed's own zero_to_fp32 of the same files
        import zeroshard

        theirs = load_file(str(folder / "expected.safetensors"))
        ours = zeroshard.load_state_dict(str(out))
        assert set(ours) == set(theirs)
        for name, value in theirs.items():  # zero_to_fp32 writes buffers as fp32; the import keeps their dtype
            if name in manifest.aliases or manifest.tensors[name].role == "param":
                assert ours[name].dtype == value.dtype, name
            assert ours[name].to(value.dtype).equal(value), name
    frozen = FROZEN if variant.startswith("frozen") else ()
    got = run_ranks(_resume, 2, path=str(out), stage=expected["stage"], steps=[3, 4, 5],
                    bf16=variant.startswith("bf16"), frozen=frozen, groups=variant.endswith("subgroups"),
                    clipping=expected["gradient_clipping"], init_process_group=False, timeout=240)[0]
    assert got["global_steps"] == 6 and got["client"] == expected["client_state"]
    assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5), (got["losses"], expected)


def test_a_saved_config_is_a_dict_a_base64_config_or_a_files_path():
    """What DeepSpeed's engine saved as ds_config: up to 0.18.0 at least, whatever initialize was given."""
    import base64

    import torch

    from zeroshard.errors import CheckpointError
    from zeroshard.interop.deepspeed_common import writer_config

    config = {"train_batch_size": 8, "bf16": {"enabled": True}}
    assert writer_config("m.pt", config) == config and writer_config("m.pt", None) == {}
    assert writer_config("m.pt", base64.urlsafe_b64encode(json.dumps(config).encode()).decode()) == config
    assert writer_config("m.pt", "configs/ds_config_zero3.json") is None
    with pytest.raises(CheckpointError, match="m.pt: ds_config must be a dict or a string, got Tensor"):
        writer_config("m.pt", torch.ones(1))
