"""`zeroshard import dcp` of checkpoints written by other torch releases than the one it runs on.

A user's DCP checkpoint was written by the torch their FSDP job ran (torch 2.4 to 2.14 here),
rarely the one they run zeroshard with; DCP's metadata is a pickle whose classes change between
releases. tests/data/dcp holds checkpoints each torch wrote itself (tools/make_dcp_fixtures.py):
every one must import with every tensor bit for bit as that torch held it, and resume with the
losses that run went on to have.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zeroshard.interop.dcp_import import read_dcp
from zeroshard.interop.imported import materialize

from distributed import run_ranks
from interop_model import zeroshard_resumed_losses

TIER = "default"  # docs/TESTING.md

FIXTURES = Path(__file__).parent / "data" / "dcp"
VERSIONS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
WITH_OPTIMIZER = ("flattened", "optimizer_key", "sharded")


def test_the_fixtures_cover_the_releases_users_arrive_with():
    assert {"torch-2.4.1", "torch-2.6.0", "torch-2.14.1"} <= set(VERSIONS)
    told = [v for v in VERSIONS if "decoupled_weight_decay" in read_dcp(FIXTURES / v / "optimizer_key").param_groups[0]]
    assert told == ["torch-2.14.1"]  # the others exercise [Note: Adam or AdamW]
    for version in VERSIONS:
        expected = json.loads((FIXTURES / version / "expected.json").read_text())
        assert expected["torch_version"].split("+")[0] == version.removeprefix("torch-")


def _resolved(imp, name: str) -> torch.Tensor:
    """The imported parameter or buffer `name`, through a tie if the import recorded one."""
    name = imp.aliases.get(name, name)
    return materialize(imp.params[name] if name in imp.params else imp.buffers[name])


@pytest.mark.parametrize("layout", [*WITH_OPTIMIZER, "plain"])
@pytest.mark.parametrize("version", VERSIONS)
def test_every_tensor_comes_back_bit_for_bit(version, layout):
    expected = load_file(FIXTURES / version / "expected.safetensors")
    imp = read_dcp(FIXTURES / version / layout)
    names = [k.split("/", 1)[1] for k in expected if not k.startswith("state/")]
    for name in names:  # every weight and the buffer, whichever kind the layout lets the import see
        kind = "param" if f"param/{name}" in expected else "buffer"
        got, want = _resolved(imp, name), expected[f"{kind}/{name}"]
        assert got.dtype == want.dtype and torch.equal(got.reshape(want.shape), want), (version, layout, name)
    if layout == "plain":
        assert not imp.optimizer_state
        return
    moments = {k for k in expected if k.startswith("state/")}
    got = {f"state/{p}/{k}": materialize(v) for p, s in imp.optimizer_state.items() for k, v in s.items()}
    assert got.keys() == moments, (version, layout)
    assert all(torch.equal(got[k].reshape(-1), expected[k].reshape(-1)) for k in moments), (version, layout)
    assert all(imp.scalar_state[n]["step"]["value"] == 3 for n in imp.params)
    assert imp.global_steps == 3
    # [Note: Adam or AdamW]: before Adam's decoupled_weight_decay option the groups cannot tell
    told = "decoupled_weight_decay" in imp.param_groups[0]
    assert imp.optimizer_class == ("torch.optim.adamw.AdamW" if told else "unknown"), imp.optimizer_class
    assert told or any("Adam or AdamW" in n for n in imp.notes), imp.notes


@pytest.mark.parametrize("version", VERSIONS)
def test_an_import_resumes_with_the_losses_of_the_run_that_wrote_it(tmp_path, version):
    from click.testing import CliRunner

    from zeroshard.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["import", "dcp", str(FIXTURES / version / "sharded"), str(out), "--world", "2"])
    assert result.exit_code == 0, result.output
    expected = json.loads((FIXTURES / version / "expected.json").read_text())["losses_after"]
    ours = run_ranks(zeroshard_resumed_losses, 2, path=str(out), init_process_group=False, timeout=240)[0]
    assert len(ours) == len(expected) == 3
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours, expected)), (ours, expected)


def test_the_optimizer_class_is_named_only_where_the_groups_say_it():
    from zeroshard.interop.imported import optimizer_class_of

    def groups(cls, drop=()):
        group = cls([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
        return [{k: v for k, v in group.items() if k not in drop}]

    assert optimizer_class_of(groups(torch.optim.AdamW)) == "torch.optim.adamw.AdamW"
    assert optimizer_class_of(groups(torch.optim.Adam)) == "torch.optim.adam.Adam"
    notes: list[str] = []  # as torch 2.6 and older saved either: [Note: Adam or AdamW]
    assert optimizer_class_of(groups(torch.optim.AdamW, drop={"decoupled_weight_decay"}), notes=notes) == "unknown"
    assert len(notes) == 1 and "Adam or AdamW" in notes[0]
    for cls in (torch.optim.RAdam, torch.optim.NAdam, torch.optim.Adamax):  # betas, but not Adam
        assert optimizer_class_of(groups(cls)) == "unknown", cls
    assert optimizer_class_of(groups(torch.optim.SGD)) == "torch.optim.sgd.SGD"
