"""`zeroshard import dcp` of every DCP layout real tools write: each checkpoint here is made by
the real tool or the real `torch.distributed.checkpoint` call (FSDP2 at world 2 on gloo), and
the import resumes with the tool's own next losses (1e-5), or is refused in one line naming
what it did not understand.

 - FSDP2 `get_state_dict(flatten_optimizer_state_dict=True)` under "optim" (torchtitan's choice);
 - FSDP2 `{"model": ..., "optimizer": ...}` (the key Accelerate and many repos use);
 - model-only `{"model": ...}` and a plain `dcp.save(model.state_dict())`, resumed with a fresh
   optimizer against FSDP2 loading the same checkpoint with a fresh optimizer;
 - torchtitan 0.3.0's CheckpointManager (model keys at the top level beside `optimizer`,
   `lr_scheduler`, `dataloader`, `train_state`), and its model-only last-step export;
 - Accelerate 1.15.0's FSDP2 save folders, written by Accelerate's own `save_fsdp_model` /
   `save_fsdp_optimizer` / `save_accelerator_state`, the calls `Accelerator.save_state` makes
   for FSDP (Accelerate runs FSDP only on accelerators: on CPU its `Accelerator` falls back to
   MULTI_CPU, so they are called directly, with a real `FullyShardedDataParallelPlugin` and
   `PartialState`).
(nested FSDP2 `{"model", "optim"}` is tests/test_interop_dcp.py's.)
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch_versions import fsdp2_reference

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.format import open_checkpoint
from zeroshard.interop.dcp_import import read_dcp

from distributed import run_ranks
from interop_model import (
    BETAS,
    FROZEN,
    LR,
    MICRO_BATCH,
    SEQ,
    WEIGHT_DECAY,
    batch,
    make_model,
    make_optimizer,
    mean_over_ranks,
    zeroshard_resumed_losses,
)

TIER = "mixed"  # docs/TESTING.md

# tools/dev.sh test --all installs torchtitan without its heavy dependencies in a folder of its own
TORCHTITAN = os.environ.get("ZEROSHARD_TORCHTITAN_PATH", os.path.join(sys.prefix, "torchtitan-0.3.0"))
_TITAN_IMPORTS = ("from torchtitan.components.checkpoint import CheckpointManager; "
                  "from torchtitan.components.optimizer import OptimizersContainer")


def _sharded(world_size: int, seed: int = 0, frozen: tuple[str, ...] = ()):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed, frozen)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model


def _fsdp2_train(rank, model, opt, save) -> list[float]:
    """FSDP2 trains 6 steps and calls save(model, opt) after step 2; the losses of steps 3-5."""
    losses = []
    for step in range(6):
        loss = model(*batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
        if step == 2:
            save(model, opt)
    return losses[3:]


def _fsdp2_layouts(rank, world_size, out):
    """One checkpoint per layout, all of the same state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    def save(model, opt):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{out}/optimizer_key")
        dcp.save({"model": msd}, checkpoint_id=f"{out}/model_only")
        dcp.save(msd, checkpoint_id=f"{out}/plain")
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/flattened")

    model = _sharded(world_size)
    return _fsdp2_train(rank, model, make_optimizer(model.parameters()), save)


def _fsdp2_fresh_optimizer(rank, world_size, path):
    """FSDP2's own continuation from a model-only checkpoint: weights loaded, a fresh optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = _sharded(world_size, seed=1)
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    opt = make_optimizer(model.parameters())
    losses = []
    for step in (3, 4, 5):
        loss = model(*batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    return losses


def _import(src, out, *extra) -> str:
    result = CliRunner().invoke(main, ["import", "dcp", str(src), str(out), "--world", "2", *extra])
    assert result.exit_code == 0, result.output
    return result.output  # stdout and stderr (the notes)


def _resumes_like(out, expected):
    ours = run_ranks(zeroshard_resumed_losses, 2, path=str(out), init_process_group=False, timeout=240)[0]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours, expected)), (ours, expected)
    assert len(ours) == len(expected) == 3


@pytest.fixture(scope="module")
def fsdp_layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    return out, run_ranks(_fsdp2_layouts, 2, out=str(out), timeout=240)[0]


def _check_trained(imp, layout_note):
    assert list(imp.params) == ["emb.weight", "norm.weight", "norm.bias", "fc.weight", "fc.bias"]
    assert imp.buffers.keys() == {"scale"} and imp.aliases == {"head.weight": "emb.weight"}
    assert all(set(imp.optimizer_state[n]) == {"exp_avg", "exp_avg_sq"} for n in imp.params)
    assert all(imp.scalar_state[n]["step"]["value"] == 3 for n in imp.params)
    assert imp.global_steps == 3 and imp.optimizer_class == "torch.optim.adamw.AdamW"
    assert [g["params"] for g in imp.param_groups] == [list(imp.params)]
    assert imp.param_groups[0]["lr"] == LR and imp.param_groups[0]["betas"] == list(BETAS)
    assert imp.notes[0] == f"DCP layout: {layout_note}"


@fsdp2_reference
def test_flattened_optimizer_resumes_like_fsdp2(tmp_path, fsdp_layouts):
    folder, fsdp_next = fsdp_layouts
    imp = read_dcp(str(folder / "flattened"))
    _check_trained(imp, "'model.*', flattened 'optim.*'")
    output = _import(folder / "flattened", tmp_path / "zs", "-q")
    assert "5 parameters" in output and "flattened" in output
    _resumes_like(tmp_path / "zs", fsdp_next)


@fsdp2_reference
def test_optimizer_key_resumes_like_fsdp2(tmp_path, fsdp_layouts):
    folder, fsdp_next = fsdp_layouts
    _check_trained(read_dcp(str(folder / "optimizer_key")), "'model.*', nested 'optimizer.*'")
    assert "5 parameters" in _import(folder / "optimizer_key", tmp_path / "zs")
    _resumes_like(tmp_path / "zs", fsdp_next)


def test_model_only_resumes_like_fsdp2_with_a_fresh_optimizer(tmp_path, fsdp_layouts):
    folder, _ = fsdp_layouts
    imp = read_dcp(str(folder / "model_only"), buffers="scale")
    assert set(imp.params) == {"emb.weight", "norm.weight", "norm.bias", "fc.weight", "fc.bias"}
    assert imp.buffers.keys() == {"scale"} and imp.aliases == {"head.weight": "emb.weight"}
    assert not imp.optimizer_state and imp.optimizer_class is None and imp.global_steps == 0
    # without --buffers the floating buffer is a parameter, and the note says how to name it
    bare = read_dcp(str(folder / "model_only"))
    assert "scale" in bare.params and any("--buffers" in n for n in bare.notes)
    # a plain dcp.save(model.state_dict()) holds the same weights under top-level keys
    plain = read_dcp(str(folder / "plain"), buffers="scale")
    assert plain.notes[0] == "DCP layout: top-level model keys, no optimizer"
    assert plain.params.keys() == imp.params.keys()
    assert all(torch.equal(plain.params[n], imp.params[n]) for n in imp.params)

    expected = run_ranks(_fsdp2_fresh_optimizer, 2, path=str(folder / "model_only"), timeout=240)[0]
    for source in ("model_only", "plain"):
        assert "5 parameters" in _import(folder / source, tmp_path / source, "--buffers", "scale")
        _resumes_like(tmp_path / source, expected)


def _fsdp2_frozen(rank, world_size, out):
    """Fine-tuning under FSDP2: FROZEN parameters have requires_grad False and the optimizer is
    given only the trainable ones, so the checkpoint's optimizer knows nothing of the frozen ones."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    def save(model, opt):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/nested")
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out}/flattened")

    model = _sharded(world_size, frozen=FROZEN)
    return _fsdp2_train(rank, model, make_optimizer([p for p in model.parameters() if p.requires_grad]), save)


@fsdp2_reference
def test_frozen_parameters_the_optimizer_does_not_hold_resume_like_fsdp2(tmp_path):
    """The checkpoint cannot tell them from buffers (the import keeps them as buffers, with a
    note); the engine's load takes a floating buffer of a frozen parameter's name and shape as
    that parameter's value. Before, the load failed with them 'missing', suggesting strict=False,
    which would have trained on with fresh frozen weights."""
    fsdp_next = run_ranks(_fsdp2_frozen, 2, out=str(tmp_path), timeout=240)[0]
    for layout in ("nested", "flattened"):
        output = _import(tmp_path / layout, tmp_path / f"zs-{layout}")
        assert "imported as buffers: scale, fc.weight, fc.bias" in output, output
        ours = run_ranks(zeroshard_resumed_losses, 2, path=str(tmp_path / f"zs-{layout}"), frozen=FROZEN,
                         init_process_group=False, timeout=240)[0]
        assert ours == pytest.approx(fsdp_next, rel=1e-5), (layout, ours, fsdp_next)


# ---- refused in one line --------------------------------------------------------------------------

def _save_single(path, state_dict):
    import torch.distributed.checkpoint as dcp

    dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def _refused(src, *extra) -> str:
    result = CliRunner().invoke(main, ["import", "dcp", str(src), str(src) + "-out", "-q", *extra])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroshard: error:"), result.output
    assert not os.path.exists(str(src) + "-out")
    return lines[0]


def test_unknown_layouts_are_refused_naming_the_keys(tmp_path):
    model = make_model(0).state_dict()
    _save_single(tmp_path / "net", {"net": model, "opt": {"lr": 0.1}})
    line = _refused(tmp_path / "net")
    assert "not understood" in line and "net.emb.weight" in line and "+" in line  # first few, then a count

    shampoo = {"state": {"fc.weight": {"preconditioner": {"left": torch.ones(2, 2)}, "step": torch.tensor(1.0)}},
               "param_groups": [{"lr": 0.1, "params": ["fc.weight"]}]}
    _save_single(tmp_path / "shampoo", {"model": model, "optim": shampoo})
    line = _refused(tmp_path / "shampoo")
    assert "optim.state.fc.weight.preconditioner.left" in line and "1 entry not understood" in line

    _save_single(tmp_path / "stray", {"model": model, "ema": {"fc.weight": torch.ones(5, 5)}})
    assert "ema.fc.weight" in _refused(tmp_path / "stray")
    _save_single(tmp_path / "both", {"model": model, "optim": {"x": 1}, "optimizer": {"x": 1}})
    assert "both 'optim.*' and 'optimizer.*'" in _refused(tmp_path / "both")
    _save_single(tmp_path / "groupless", {"model": model, "optim": {"param_groups": [{"lr": 0.1}]}})
    assert "param group(s) 0 of 'optim' have no `params` list" in _refused(tmp_path / "groupless")
    _save_single(tmp_path / "nomodel", {"optim": {"state": {"w": {"exp_avg": torch.ones(2)}}}})
    assert "no model weights" in _refused(tmp_path / "nomodel")


def test_buffers_option_is_checked(tmp_path):
    model = make_model(0)
    opt = make_optimizer(model.parameters())
    model(*batch(0, 0)).backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    _save_single(tmp_path / "ck", {"model": msd, "optim": osd, "step": torch.tensor(1), "note": "run 7"})
    assert "--buffers matches parameters the optimizer holds: fc.bias" in _refused(tmp_path / "ck", "--buffers",
                                                                                   "fc.bias")
    assert "is not a regular expression" in _refused(tmp_path / "ck", "--buffers", "(")
    assert "'scal' matches no model tensor" in _refused(tmp_path / "ck", "--buffers", "scal")  # a full match
    imp = read_dcp(str(tmp_path / "ck"))  # with the optimizer, the floating buffer is named in a note
    assert any(n.startswith("floating tensors the optimizer does not hold, imported as buffers: scale (")
               for n in imp.notes), imp.notes
    assert imp.client_state == {"step": 1, "note": "run 7"}  # scalars beside the model: client state


def test_constant_tensors_are_never_taken_for_ties(tmp_path):
    """Two fresh LayerNorms hold equal weights (ones) without being one parameter."""
    sd = {"a.weight": torch.ones(4), "b.weight": torch.ones(4), "w": torch.arange(8.0), "w2": torch.arange(8.0),
          "n": torch.arange(3)}
    _save_single(tmp_path / "ck", {"model": sd})
    imp = read_dcp(str(tmp_path / "ck"))
    assert set(imp.params) == {"a.weight", "b.weight", "w"} and imp.aliases == {"w2": "w"}
    assert imp.buffers.keys() == {"n"}  # not floating: a buffer


# ---- torchtitan ------------------------------------------------------------------------------------

class _TrainState:
    """torchtitan's Trainer is the checkpoint's `train_state` Stateful with exactly this state."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


class _Loader:
    """torchtitan's ParallelAwareDataloader.state_dict layout: its rank's state as pickle bytes."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self):
        return {f"dp_rank_{self.rank}": pickle.dumps({"offset": 3}), "world_size": 2}

    def load_state_dict(self, sd):
        pass


def _torchtitan(rank, world_size, base):
    sys.path.insert(0, TORCHTITAN)
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig

    model = _sharded(world_size)
    kwargs = {"lr": LR, "betas": BETAS, "weight_decay": WEIGHT_DECAY}
    opts = OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kwargs)],
        implementation="for-loop"), model_parts=[model])
    scheds = LRSchedulersContainer(opts, lambda step: 1.0)
    train = _TrainState()
    ckpt = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", interval=3, keep_latest_k=0,
                                                      last_save_model_only=True),
                             dataloader=_Loader(rank), model_parts=[model], optimizers=opts, lr_schedulers=scheds,
                             states={"train_state": train}, sd_adapter=None, base_folder=base)
    losses = []
    for step in range(6):
        loss = model(*batch(step, rank))
        loss.backward()
        opts.step()
        scheds.step()
        opts.zero_grad()
        train.step, train.ntokens_seen = step + 1, train.ntokens_seen + batch(step, rank)[0].numel()
        losses.append(mean_over_ranks(loss))
        ckpt.save(train.step, last_step=step == 5)
    ckpt.close()
    return losses[3:]


@pytest.mark.slow
def test_torchtitan_checkpoint_manager(tmp_path):
    import subprocess

    probe = subprocess.run([sys.executable, "-c", _TITAN_IMPORTS], env={**os.environ, "PYTHONPATH": TORCHTITAN},
                           capture_output=True, timeout=120)
    if probe.returncode:
        pytest.skip(f"torchtitan 0.3.0 does not import from {TORCHTITAN} (tools/dev.sh test --all installs it)")
    titan_next = run_ranks(_torchtitan, 2, base=str(tmp_path), timeout=300, fresh=True)[0]
    step3 = tmp_path / "ckpt" / "step-3"
    imp = read_dcp(str(step3))
    _check_trained(imp, "top-level model keys, flattened 'optimizer.*'")
    assert imp.client_state["train_state"] == {"step": 3, "ntokens_seen": 3 * MICRO_BATCH * SEQ}
    assert imp.client_state["lr_scheduler"] == {"last_epoch": 3}
    assert imp.client_state["dataloader"] == {"world_size": 2}
    assert any("not imported" in n and "dataloader.dp_rank_0" in n for n in imp.notes)
    output = _import(step3, tmp_path / "zs")
    assert "dataloader.dp_rank_1" in output  # the dropped pickle bytes are named to the user
    _resumes_like(tmp_path / "zs", titan_next)

    last = read_dcp(str(tmp_path / "ckpt" / "step-6"), buffers="scale")  # last_save_model_only
    assert last.notes[0] == "DCP layout: top-level model keys, no optimizer"
    assert set(last.params) == set(imp.params) and not last.optimizer_state


# ---- Accelerate -----------------------------------------------------------------------------------

def _accelerate(rank, world_size, out, full):
    from accelerate import PartialState
    from accelerate.checkpointing import save_accelerator_state
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer

    state = PartialState(cpu=True)  # joins the gloo group; what the save functions read of an Accelerator
    model = _sharded(world_size)
    opt = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # counts steps, keeps LR
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    # FULL_STATE_DICT: the plugin's default with FSDP1 (SHARDED's with FSDP2); the same two pickles either way
    full_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
    losses = []
    for step in range(6):
        loss = model(*batch(step, rank))
        loss.backward()
        opt.step()
        scheduler.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
        if step == 2:  # what Accelerator.save_state does for FSDP, in its order
            save_fsdp_model(plugin, state, model, out)
            save_fsdp_optimizer(plugin, state, opt, model, out)
            save_accelerator_state(out, [], [], [scheduler], [], rank, step + 1)
            save_fsdp_model(full_plugin, state, model, full)  # the default: two pickles, no DCP
            save_fsdp_optimizer(full_plugin, state, opt, model, full)
            save_accelerator_state(full, [], [], [scheduler], [], rank, step + 1)
    return losses[3:]


@pytest.mark.slow
@fsdp2_reference
def test_accelerate_fsdp_save_state(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (tools/dev.sh test --all installs it)")
    out, full = tmp_path / "save_state", tmp_path / "full_state"
    acc_next = run_ranks(_accelerate, 2, out=str(out), full=str(full), timeout=300, fresh=True)[0]
    assert (out / "pytorch_model_fsdp_0" / ".metadata").exists() and (out / "optimizer_0" / ".metadata").exists()
    imp = read_dcp(str(out))
    _check_trained(imp, "'model.*', nested 'optimizer.*'")
    assert any(n.startswith("RNG streams of the 2 ranks read (random_states_0.pkl, ...)") for n in imp.notes)
    assert imp.stateful["lr_scheduler"]["last_epoch"] == 3  # scheduler.bin: carried, not named as dropped
    for rank in range(2):  # each process's RNG streams: its rank's, from random_states_{rank}.pkl
        saved = torch.load(out / f"random_states_{rank}.pkl", weights_only=False)  # trusted: written just now
        assert torch.equal(imp.rank_states[rank]["rng"]["torch"], saved["torch_manual_seed"])
    assert any(n.startswith("LR scheduler state carried: lr_scheduler from scheduler.bin") for n in imp.notes)
    _import(out, tmp_path / "zs")
    _resumes_like(tmp_path / "zs", acc_next)
    # the Trainer with FSDP writes this folder as its checkpoint-N, with its trainer_state.json beside
    shutil.copy(Path(__file__).parent / "data" / "deepspeed" / "hf_trainer" / "checkpoint-3" / "trainer_state.json",
                out)
    assert read_dcp(str(out)).client_state["hf_trainer_state"]["global_step"] == 3
    # the model folder alone imports too, and says where the optimizer state was left
    alone = read_dcp(str(out / "pytorch_model_fsdp_0"), buffers="scale")
    assert any("sibling optimizer_0/" in n for n in alone.notes) and not alone.optimizer_state

    with pytest.raises(CheckpointError, match="several models or optimizers"):
        (out / "optimizer_1").mkdir()
        read_dcp(str(out))

    # FULL_STATE_DICT (FSDP1's default): pytorch_model_fsdp.bin + optimizer.bin, pickles by FQN
    assert sorted(p.name for p in full.iterdir() if p.suffix == ".bin") == ["optimizer.bin", "pytorch_model_fsdp.bin",
                                                                           "scheduler.bin"]
    imp = read_dcp(str(full))
    assert imp.notes[0] == "Accelerate full state dict layout: 'model.*', nested 'optimizer.*'"
    imp.notes[0] = "DCP layout: 'model.*', nested 'optimizer.*'"  # otherwise checked as the DCP one
    _check_trained(imp, "'model.*', nested 'optimizer.*'")
    assert imp.stateful["lr_scheduler"]["last_epoch"] == 3
    _import(full, tmp_path / "zs_full")
    _resumes_like(tmp_path / "zs_full", acc_next)
    (full / "optimizer_1.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="several models or optimizers"):
        read_dcp(str(full))


def test_flattened_groups_are_rebuilt_like_the_nested_ones(tmp_path):
    """Two groups (decay / no decay, members interleaved in model order): flattened, the layout
    keeps only each parameter's hyperparameters; the groups rebuilt equal the nested layout's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = make_model(0)
    decay = [model.emb.weight, model.fc.weight]
    rest = [model.norm.weight, model.norm.bias, model.fc.bias]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=LR, betas=BETAS)
    model(*batch(0, 0)).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    _save_single(tmp_path / "nested", {"model": msd, "optim": osd})
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    _save_single(tmp_path / "flat", {"model": msd, "optim": osd})
    nested, flat = read_dcp(str(tmp_path / "nested")), read_dcp(str(tmp_path / "flat"))
    assert [g["params"] for g in flat.param_groups] == [["emb.weight", "fc.weight"],
                                                        ["norm.weight", "norm.bias", "fc.bias"]]
    assert flat.param_groups == nested.param_groups
    assert [g["weight_decay"] for g in flat.param_groups] == [0.01, 0.0]
    assert any("2 group(s) of equal hyperparameters" in n for n in flat.notes)
    for name, state in nested.optimizer_state.items():
        assert all(torch.equal(state[k], flat.optimizer_state[name][k]) for k in state)


def test_a_torch_schedulers_state_saved_beside_is_carried_as_the_lr_scheduler(tmp_path):
    """dcp.save({"model", "optim", "lr_scheduler": sched.state_dict()}), the usual FSDP2 script:
    the schedule comes across as what load_checkpoint(lr_scheduler=...) restores, not as client
    state it would never look at (torchtitan's {"last_epoch"} alone stays client state, above)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = make_model(0)
    opt = make_optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(2):
        model(*batch(step, 0)).backward()
        opt.step()
        sched.step()
    msd, osd = get_state_dict(model, opt)
    _save_single(tmp_path / "ck", {"model": msd, "optim": osd, "lr_scheduler": sched.state_dict(),
                                   "epoch": 1})
    output = _import(tmp_path / "ck", tmp_path / "zs")
    assert "LR scheduler state carried: lr_scheduler" in output and "carried into client_state: epoch" in output
    _, manifest = open_checkpoint(str(tmp_path / "zs"))
    assert manifest.extra["stateful"] == {"lr_scheduler": sched.state_dict()}
    assert manifest.client_state == {"epoch": 1}
    fresh = torch.optim.lr_scheduler.StepLR(make_optimizer(make_model(1).parameters()), step_size=1, gamma=0.5)
    fresh.load_state_dict(manifest.extra["stateful"]["lr_scheduler"])
    assert fresh.get_last_lr() == sched.get_last_lr() == [LR / 4]


# ---- streaming: tensors read by range, never the whole model at once --------------------------
def _tensors(imp) -> dict[str, torch.Tensor]:
    from zeroshard.interop.imported import materialize

    out = {f"param/{k}": materialize(v) for k, v in imp.params.items()}
    out.update({f"buffer/{k}": materialize(v) for k, v in imp.buffers.items()})
    out.update({f"state/{p}/{k}": materialize(v) for p, s in imp.optimizer_state.items() for k, v in s.items()})
    return {k: v.reshape(-1) for k, v in out.items()}  # optimizer state is flat either way


@pytest.mark.parametrize("layout", ["flattened", "optimizer_key", "model_only", "plain"])
def test_lazy_reads_give_the_same_tensors_as_whole_reads(fsdp_layouts, monkeypatch, layout):
    from zeroshard.interop import dcp_chunks
    from zeroshard.interop.imported import LazyTensor

    monkeypatch.setattr(dcp_chunks, "LAZY_BYTES", 1 << 40)
    whole = read_dcp(fsdp_layouts[0] / layout)
    monkeypatch.setattr(dcp_chunks, "LAZY_BYTES", 0)
    lazy = read_dcp(fsdp_layouts[0] / layout)
    assert any(isinstance(v, LazyTensor) for v in lazy.params.values())
    assert not any(isinstance(v, LazyTensor) for v in whole.params.values())
    a, b = _tensors(whole), _tensors(lazy)
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert (whole.aliases, whole.notes, whole.scalar_state) == (lazy.aliases, lazy.notes, lazy.scalar_state)
    for name, value in lazy.params.items():  # ranges that cut rows and chunks anywhere
        flat = a[f"param/{name}"].reshape(-1)
        for start, end in [(0, 1), (1, flat.numel() - 1), (flat.numel() // 2, flat.numel()), (3, 3)]:
            if 0 <= start <= end <= flat.numel():
                assert torch.equal(value.read(start, end), flat[start:end]), (name, start, end)


@fsdp2_reference
def test_a_lazy_import_resumes_like_fsdp2(tmp_path, fsdp_layouts, monkeypatch):
    from zeroshard.interop import dcp_chunks

    monkeypatch.setattr(dcp_chunks, "LAZY_BYTES", 0)
    _import(fsdp_layouts[0] / "flattened", tmp_path / "out")
    _resumes_like(tmp_path / "out", fsdp_layouts[1])


_ACCELERATE_DDP = """
import sys, torch
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.backward(model(torch.randn(2, 4)).sum())
optimizer.step()
accelerator.save_state(sys.argv[1])
"""


@pytest.mark.slow
def test_accelerate_save_state_without_fsdp_is_refused_with_the_way_to_its_weights(tmp_path):
    """Accelerate's plain (DDP or one-process) save_state writes model.safetensors and torch's
    optimizer.state_dict() as optimizer.bin, keyed by parameter index in the order the script
    built its groups, which no file records: refused by name, pointing at `shard`, which works."""
    pytest.importorskip("accelerate", reason="accelerate is not installed (tools/dev.sh test --all installs it)")
    out = tmp_path / "state"
    subprocess.run([sys.executable, "-c", _ACCELERATE_DDP, str(out)], check=True, timeout=120,
                   env=dict(os.environ, ACCELERATE_USE_CPU="1"), capture_output=True)
    assert {"model.safetensors", "optimizer.bin"} <= {p.name for p in out.iterdir()}
    result = CliRunner().invoke(main, ["import", "dcp", str(out), str(tmp_path / "zs"), "-q"])
    assert result.exit_code == 1 and "an Accelerate save_state without FSDP or DeepSpeed" in result.output
    command = result.output.split("`")[1].replace("OUT", str(tmp_path / "sharded")).replace(" N", " 2").split()
    assert command[:2] == ["zeroshard", "shard"] and not (tmp_path / "zs").exists()
    assert CliRunner().invoke(main, [*command[1:], "-q"]).exit_code == 0
