"""`zeroshard import dcp` of Accelerate's `save_state` without FSDP or DeepSpeed
(tests/data/accelerate_plain, written by Accelerate 1.15.0 itself through
tools/make_accelerate_fixtures.py; Accelerate is not needed here): the weights, Adam's moments by
parameter name, the schedule, registered objects and RNG streams come across, and the engine
resumes with Accelerate's own next losses."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from safetensors.torch import load_file

from zeroshard.cli import main
from zeroshard.format import open_checkpoint

from distributed import run_ranks
from interop_model import batch, make_model, make_optimizer, two_groups, warmup

TIER = "mixed"  # docs/TESTING.md: the imports are in-process; the engine resumes (1 and 2 ranks) are slow

FIXTURES = Path(__file__).parent / "data" / "accelerate_plain"
NAMES = ["emb.weight", "norm.weight", "norm.bias", "fc.weight", "fc.bias"]  # TinyTied.named_parameters()


def _import(src: Path, out: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["import", "dcp", str(src), str(out), "-q", *extra])
    return result.exit_code, result.output


def _names_file(tmp_path: Path, names: list[str]) -> str:
    path = tmp_path / "names.txt"
    path.write_text("\n".join(names) + "\n")
    return str(path)


def _saved_optimizer(src: Path) -> dict:
    return torch.load(src / "optimizer.bin", weights_only=True)  # the test reads the pickle; zeroshard never does


def _assert_same_tensors(src: Path, out: Path, names: list[str]) -> None:
    """The weights equal model.safetensors and each index's moments its parameter's, bit for bit."""
    import zeroshard

    theirs = load_file(str(src / "model.safetensors"))
    ours = zeroshard.load_state_dict(str(out))
    assert theirs and all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())
    saved = _saved_optimizer(src)
    assert sorted(saved["state"]) == list(range(len(names)))
    with zeroshard.open_tensors(str(out), roles=None) as ckpt:
        for index, name in enumerate(names):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ckpt[f"optimizer/{key}/{name}"], saved["state"][index][key]), (index, name, key)


def test_plain_save_state_imports_with_the_optimizers_parameter_order(tmp_path):
    """One process, AdamW(model.parameters()): optimizer.bin names no parameter, so the order comes
    from --param-names; norm.weight, norm.bias and fc.bias share a shape, and only the order tells
    their moments apart (the weights file sorts its names). Schedule, registered object and the RNG
    streams come across; sampler-like pickles and unknown files are named, not dropped silently."""
    src = FIXTURES / "single" / "checkpoint"
    work = tmp_path / "src"
    shutil.copytree(src, work)
    (work / "sampler.bin").write_bytes(b"not read")  # what a run with Accelerate's seedable sampler adds
    (work / "notes.txt").write_text("mine")
    listed = CliRunner().invoke(main, ["ls", str(src.parent)]).output  # ls names the command to run
    assert f"FOREIGN: an Accelerate save_state (no FSDP or DeepSpeed): `zeroshard import dcp {src} OUT`" in listed
    out = tmp_path / "imported"
    code, output = _import(work, out, "--param-names", _names_file(tmp_path, NAMES))
    assert code == 0, output
    assert "Accelerate save_state (no FSDP or DeepSpeed) layout" in output, output
    assert "optimizer.bin's parameter indices named by --param-names FILE" in output
    assert "LR scheduler state carried: lr_scheduler from scheduler.bin" in output
    assert "registered objects carried as Stateful state: custom_checkpoint_0" in output
    assert "RNG streams of the 1 ranks read (random_states_0.pkl)" in output
    assert "Accelerate save_state, not imported (pickles are not read): notes.txt, sampler.bin" in output, output
    _assert_same_tensors(src, out, NAMES)
    _, manifest = open_checkpoint(str(out))
    scheduler = torch.load(src / "scheduler.bin", weights_only=True)
    assert manifest.step == 3 and manifest.world_size == 1
    assert manifest.extra["stateful"]["lr_scheduler"]["last_epoch"] == scheduler["last_epoch"] == 3
    assert manifest.extra["stateful"]["lr_scheduler"]["_last_lr"] == scheduler["_last_lr"]
    assert manifest.extra["stateful"]["custom_checkpoint_0"] == {"seen": 3}
    assert [g["params"] for g in manifest.optimizer["param_groups"]] == [NAMES]


def test_named_optimizer_imports_by_torchs_own_names(tmp_path):
    """2 DDP processes with two param groups built from named_parameters(): torch records each
    group's param_names, so no option is needed; both processes' RNG streams are read."""
    src = FIXTURES / "ddp_named" / "checkpoint"
    out = tmp_path / "imported"
    code, output = _import(src, out)
    assert code == 0, output
    assert "named by the param groups' param_names" in output and "RNG streams of the 2 ranks read" in output
    order = ["emb.weight", "fc.weight", "norm.weight", "norm.bias", "fc.bias"]
    _assert_same_tensors(src, out, order)
    _, manifest = open_checkpoint(str(out))
    assert manifest.world_size == 2 and manifest.step == 3
    groups = manifest.optimizer["param_groups"]
    assert [g["params"] for g in groups] == [order[:2], order[2:]] and [g["weight_decay"] for g in groups] == [0.01, 0]
    assert not any("param_names" in g for g in groups)  # `params` holds the names
    # the same names given again agree; another order is refused
    code, _ = _import(src, tmp_path / "again", "--param-names", _names_file(tmp_path, order))
    assert code == 0
    code, output = _import(src, tmp_path / "other", "--param-names", _names_file(tmp_path, NAMES))
    assert code == 1 and "gives other names or another order" in output and not (tmp_path / "other").exists()


@pytest.mark.parametrize("names, needle", [
    (None, "checkpoint: an Accelerate save_state without FSDP or DeepSpeed, whose optimizer.bin keys its state by "
           "parameter index in the order the script gave the optimizer its parameters, which it does not record"),
    (NAMES[:4], "holds 5 parameters (param groups of [5]), and --param-names FILE names 4"),
    (["emb.weight", "fc.weight", "norm.weight", "norm.bias", "fc.bias"],
     "state 'exp_avg' of index 1 has shape [5], but the model's parameter 1 is 'fc.weight' of [5, 5]"),
    (["emb.weight", "norm.weight", "norm.weight", "fc.weight", "fc.bias"], "name a parameter twice: norm.weight"),
    (["emb.weight", "norm.weight", "norm.bias", "fc.weight", "head.bias"], "'head.bias' (index 4) is not in the "
                                                                          "weights file"),
])
def test_an_order_that_cannot_be_known_or_does_not_fit_is_refused(tmp_path, names, needle):
    """One line naming optimizer.bin and what is wrong, and nothing written."""
    extra = () if names is None else ("--param-names", _names_file(tmp_path, names))
    out = tmp_path / "refused"
    code, output = _import(FIXTURES / "single" / "checkpoint", out, *extra)
    assert code == 1 and needle in output and output.count("\n") == 1, output
    assert "optimizer.bin" in output and not out.exists()


def test_what_the_import_does_not_take_is_refused_in_one_line(tmp_path):
    """A second optimizer, and --param-names given to another kind of checkpoint."""
    work = tmp_path / "two"
    shutil.copytree(FIXTURES / "single" / "checkpoint", work)
    shutil.copy(work / "optimizer.bin", work / "optimizer_1.bin")
    code, output = _import(work, tmp_path / "out", "--param-names", _names_file(tmp_path, NAMES))
    assert code == 1 and "several models or optimizers (optimizer_1.bin)" in output, output
    (work / "optimizer_1.bin").unlink()
    (work / "optimizer.bin").rename(work / "optimizer.pt")  # not Accelerate's any more
    code, output = _import(work, tmp_path / "out", "--param-names", _names_file(tmp_path, NAMES))
    assert code == 1 and output.count("\n") == 1, output
    assert not (tmp_path / "out").exists()


def _resume(rank: int, world_size: int, path: str, groups: bool, scheduler_steps: int) -> dict:
    """The engine resumes the import as the Accelerate script would go on (no clipping, the
    LambdaLR stepped as AcceleratedScheduler steps it): steps 3-5; first the RNG draws."""
    import zeroshard

    model = make_model(1)
    engine = zeroshard.initialize(model=model, optimizer=make_optimizer(two_groups(model) if groups else
                                                                        model.parameters()),
                                  config={"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
                                          "train_micro_batch_size_per_gpu": 4})
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warmup)
    engine.load_checkpoint(path, lr_scheduler=scheduler)
    draws = {"torch": torch.rand(3).tolist(), "python": random.random(), "numpy": np.random.rand(2).tolist()}
    losses = []
    for step in (3, 4, 5):
        loss = engine(*batch(step, rank))
        engine.backward(loss)
        engine.step()
        for _ in range(scheduler_steps):
            scheduler.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return {"losses": losses, "draws": draws}


def _accelerates_draws(path: Path) -> dict:
    """What Accelerate's load_state sets the generators to, from its own file (a trusted fixture)."""
    multiarray = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray  # NumPy 1 and 2
    numpy_globals = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), multiarray._reconstruct]
    with torch.serialization.safe_globals(numpy_globals):
        saved = torch.load(path, weights_only=True)
    torch.set_rng_state(saved["torch_manual_seed"])
    random.setstate(saved["random_state"])
    np.random.set_state(saved["numpy_random_seed"])
    return {"torch": torch.rand(3).tolist(), "python": random.random(), "numpy": np.random.rand(2).tolist()}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["single", "ddp_named"])
def test_engine_resumes_with_accelerates_own_losses(tmp_path, variant):
    """The import resumed by the engine at the saving world size continues with the losses of
    Accelerate's own load_state resume, and each rank draws what Accelerate's resume would."""
    expected = json.loads((FIXTURES / variant / "expected.json").read_text())
    assert expected["accelerate_version"] == "1.15.0"
    src = FIXTURES / variant / "checkpoint"
    out = tmp_path / "imported"
    extra = ("--param-names", _names_file(tmp_path, NAMES)) if variant == "single" else ()
    code, output = _import(src, out, *extra)
    assert code == 0, output
    world = expected["world_size"]
    got = run_ranks(_resume, world, path=str(out), groups=variant == "ddp_named",
                    scheduler_steps=expected["scheduler_steps_per_step"], init_process_group=False)
    assert got[0]["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5), (got[0], expected)
    assert expected["losses_resumed"] == expected["losses_after"]  # Accelerate's resume is exact here
    for rank in range(world):
        assert got[rank]["draws"] == _accelerates_draws(src / f"random_states_{rank}.pkl"), rank
