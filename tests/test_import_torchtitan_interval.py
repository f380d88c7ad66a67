"""`zeroshard import dcp` of torchtitan 0.3.0's interval checkpoint (tests/data/torchtitan, written
by its own CheckpointManager: tools/make_torchtitan_fixtures.py): the model entries hold the
split wq/wk/wv of the fused `wqkv` parameter its optimizer state is keyed by. The import is
compared bit for bit with the DCP files read by torch.distributed.checkpoint's own loader and
with the parameters the live module held (reference_params.safetensors), without torchtitan;
the resume with torchtitan's model class under zeroshard's engine needs torchtitan.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.interop.dcp_import import read_dcp

from distributed import run_ranks

TIER = "mixed"  # docs/TESTING.md: the import tests run in-process; the engine resume (2 ranks, torchtitan) is slow

FIXTURE = Path(__file__).parent / "data" / "torchtitan" / "interval"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
CKPT = FIXTURE / EXPECTED["checkpoint"]
HEAD_DIM = EXPECTED["head_dim"]


def _dcp_tensors() -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read by torch.distributed.checkpoint's own loader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(CKPT)).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(CKPT), no_dist=True)
    return state


def _reference() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(FIXTURE / "reference_params.safetensors"))


def _fused(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """FusedQKVLinear's rows: per KV head, its queries, then its key, then its value."""
    n_kv = wk.shape[0] // HEAD_DIM
    rows = [t.reshape(n_kv, -1, HEAD_DIM, wq.shape[1]) for t in (wq, wk, wv)]
    return torch.cat(rows, dim=1).reshape(-1, wq.shape[1])


def test_refused_without_head_dim_in_one_line():
    with pytest.raises(CheckpointError) as err:
        read_dcp(str(CKPT))
    message = str(err.value)
    assert "\n" not in message and "--head-dim" in message and "layers.0.attention.qkv_linear.wqkv.weight" in message
    assert "not understood" not in message
    with pytest.raises(CheckpointError, match="do not fuse with head_dim 3"):
        read_dcp(str(CKPT), head_dim=3)


def test_import_is_bit_exact(tmp_path):
    imp = read_dcp(str(CKPT), head_dim=HEAD_DIM)
    dcp_state, reference = _dcp_tensors(), _reference()
    names = EXPECTED["param_names"]  # the module's named_parameters(), fused wqkv included
    assert list(imp.params) == names and not imp.aliases and not imp.buffers
    assert [g["params"] for g in imp.param_groups] == [names]
    for name in names:
        assert torch.equal(imp.params[name], reference[name]), name  # what the live module held
        if "wqkv" in name:
            parts = [dcp_state[name.replace("wqkv", p)] for p in ("wq", "wk", "wv")]
            assert torch.equal(imp.params[name], _fused(*parts)), name
        else:
            assert torch.equal(imp.params[name], dcp_state[name]), name
        for k in ("exp_avg", "exp_avg_sq"):  # the optimizer's own state, keyed by the fused names
            assert torch.equal(imp.optimizer_state[name][k], dcp_state[f"optimizer.state.{name}.{k}"].reshape(-1))
        assert imp.scalar_state[name]["step"]["value"] == EXPECTED["step"]
    lr = EXPECTED["lrs_after"][0]  # the schedule's lr for the next step, set after step 3
    assert imp.param_groups[0]["lr"] == pytest.approx(lr) and imp.param_groups[0]["initial_lr"] == 8e-3
    assert imp.global_steps == EXPECTED["step"] and imp.optimizer_class == "torch.optim.adamw.AdamW"
    assert imp.client_state["train_state"]["step"] == EXPECTED["step"]
    assert imp.client_state["lr_scheduler"] == {"last_epoch": EXPECTED["step"]}
    assert any("dataloader.dp_rank_0" in n and "dataloader.dp_rank_1" in n for n in imp.notes)

    out = tmp_path / "zs"
    result = CliRunner().invoke(main, ["import", "dcp", str(CKPT), str(out), "--world", "2",
                                       "--head-dim", str(HEAD_DIM)])
    assert result.exit_code == 0, result.output
    assert "dataloader.dp_rank_1" in result.output  # named to the user, not dropped silently
    import zeroshard

    with zeroshard.open_tensors(str(out), roles=None) as ckpt:
        for name in names:
            assert torch.equal(ckpt[name], reference[name]), name
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ckpt[f"optimizer/{k}/{name}"].reshape(-1),
                                   dcp_state[f"optimizer.state.{name}.{k}"].reshape(-1)), (name, k)
        assert not [n for n in ckpt.keys() if "wq." in n or "wk." in n or "wv." in n]


def _resume(rank: int, world_size: int, path: str) -> tuple[list[float], list[float]]:
    """zeroshard's engine resumes the import with torchtitan's model class and schedule and trains
    the steps torchtitan trained after its own resume; the mean losses and the lrs used."""
    import torchtitan_model as tm

    import zeroshard

    model = tm.make_model(1)  # other weights: the checkpoint must replace them
    engine = zeroshard.initialize(model=model, config={"zero_optimization": {"stage": 3}},
                                  optimizer=lambda params: torch.optim.AdamW(
                                      params, lr=tm.LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    schedulers = tm.lr_schedulers([engine.optimizer])  # built before the load, as torchtitan's trainer does
    client = engine.load_checkpoint(path)
    schedulers.load_state_dict(client["lr_scheduler"])
    losses, lrs = [], []
    for step in range(client["train_state"]["step"], 6):
        lrs.append(engine.optimizer.param_groups[0]["lr"])
        loss = tm.loss_of(engine, step, rank)
        engine.backward(loss)
        engine.step()
        schedulers.step()
        losses.append(tm.mean_over_ranks(loss))
    return losses, lrs


@pytest.mark.slow
def test_resume_reproduces_torchtitan_losses(tmp_path):
    import torchtitan_model as tm

    probe = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import torchtitan_model as "
                            "tm; tm.make_model(0)"], cwd=Path(__file__).parents[1], capture_output=True, timeout=180)
    if probe.returncode:
        reason = f"torchtitan {tm.VERSION} does not import from {tm.TORCHTITAN} (tools/dev.sh test --all installs it)"
        print(reason)
        pytest.skip(reason)
    out = tmp_path / "zs"
    result = CliRunner().invoke(main, ["import", "dcp", str(CKPT), str(out), "--head-dim", str(HEAD_DIM)])
    assert result.exit_code == 0, result.output
    losses, lrs = run_ranks(_resume, 2, path=str(out), init_process_group=False, timeout=300, fresh=True)[0]
    expected = EXPECTED["losses_resumed"]
    assert len(losses) == len(expected) == 3
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, expected)), (losses, expected)
    assert lrs == pytest.approx(EXPECTED["lrs_resumed"], rel=1e-12)
