"""`zeroshard import deepspeed`: real DeepSpeed checkpoints (tests/data/deepspeed, written by
tools/make_deepspeed_fixtures.py with DeepSpeed itself) become zeroshard checkpoints that the
engine resumes from with exactly the losses DeepSpeed's own resume produced."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.format import open_checkpoint
from zeroshard.interop.deepspeed_ckpt import read_deepspeed

from distributed import run_ranks
from interop_model import (
    BETAS,
    FP16,
    FROZEN,
    LR,
    MICRO_BATCH,
    WEIGHT_DECAY,
    TrainerTied,
    batch,
    make_model,
    make_optimizer,
    trainer_batch,
    two_groups,
    warmup,
)

TIER = "mixed"  # docs/TESTING.md

FIXTURES = Path(__file__).parent / "data" / "deepspeed"


def _import(src: Path, out: Path, *extra: str) -> str:
    result = CliRunner().invoke(main, ["import", "deepspeed", str(src), str(out), "-q", *extra])
    assert result.exit_code == 0, result.output
    return result.output


def _resume(rank: int, world_size: int, path: str, stage: int, steps: list[int], bf16: bool = False,
            frozen: tuple[str, ...] = (), scheduler_steps: int = 0, fp16: dict | None = None,
            groups: bool = False, clipping: float = 1.0) -> dict:
    """Resume `path` and train `steps`; with `scheduler_steps`, a LambdaLR(warmup) restored from the
    checkpoint is stepped that many times after each step (as Accelerate stepped it); with
    `groups`, the optimizer has interop_model.two_groups."""
    import zeroshard

    model = make_model(1, frozen)
    optimizer = make_optimizer(two_groups(model)) if groups else make_optimizer
    config = {"zero_optimization": {"stage": stage}, "gradient_clipping": clipping,
              "train_micro_batch_size_per_gpu": MICRO_BATCH,
              "bf16": {"enabled": bf16}, "fp16": fp16 or {"enabled": False}}
    if bf16 or (fp16 or {}).get("enabled"):  # the fixtures' model was cast whole, its `scale` buffer too
        config["data_types"] = {"buffer_dtype": "bf16" if bf16 else "fp16"}  # (make_deepspeed_fixtures.py)
    engine = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    # gradient_clipping 1.0: DeepSpeed 0.19's default (GRADIENT_CLIPPING_DEFAULT; 0.0 up to 0.16), in force in the
    # fixtures; those of older releases record theirs (tests/test_deepspeed_releases.py)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, warmup) if scheduler_steps else None
    client = engine.load_checkpoint(path, lr_scheduler=scheduler)
    losses = []
    for step in steps:
        tokens, targets = batch(step, rank)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        for _ in range(scheduler_steps):
            scheduler.step()
        mean = loss.detach().float()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return {"losses": losses, "client": client, "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps, "loss_scale": engine.loss_scale}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_from_deepspeed_equals_deepspeed_resume(tmp_path, stage):
    expected = json.loads((FIXTURES / f"stage{stage}" / "expected.json").read_text())
    out = tmp_path / "imported"
    _import(FIXTURES / f"stage{stage}", out)
    _, manifest = open_checkpoint(str(out))
    assert manifest.step == 3 and manifest.zero_stage == stage and manifest.aliases == {"head.weight": "emb.weight"}
    steps = list(range(len(expected["losses_before"]),
                       len(expected["losses_before"]) + len(expected["losses_resumed"])))
    # resume at the source's world size and stage, and at another stage (the format is stage-free)
    for engine_stage in (stage, 3 if stage != 3 else 1):
        got = run_ranks(_resume, 2, path=str(out), stage=engine_stage, steps=steps, init_process_group=False)[0]
        assert got["client"] == expected["client_state"]
        assert got["global_steps"] == 3 + len(steps)
        for mine, theirs in zip(got["losses"], expected["losses_resumed"]):
            assert math.isclose(mine, theirs, rel_tol=1e-5), (engine_stage, got["losses"], expected["losses_resumed"])


# variant fixture -> (what to pass to `import deepspeed`, bf16 compute)
VARIANTS = {"offload": (".", False), "offload_stage3": (".", False), "bf16": (".", True),
            "bf16_stage2": (".", True), "bf16_stage3": (".", True), "hf": ("checkpoint-3", False),
            "universal": (".", False), "universal_stage3": (".", False),
            "frozen_stage1": (".", False), "frozen_stage2": (".", False), "frozen_stage3": (".", False),
            "frozen_universal_stage3": (".", False), "accelerate": (".", False), "accelerate_lambdalr": (".", False)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deepspeed_variants_resume_with_deepspeeds_own_losses(tmp_path, variant):
    """Layouts real runs produce (tools/make_deepspeed_fixtures.py): the import resumes with the
    losses DeepSpeed's own resume of the same checkpoint produced."""
    src, bf16 = VARIANTS[variant]
    expected = json.loads((FIXTURES / variant / "expected.json").read_text())
    out = tmp_path / "imported"
    output = _import(FIXTURES / variant / src, out)
    _, manifest = open_checkpoint(str(out))
    assert manifest.step == 3 and manifest.aliases == {"head.weight": "emb.weight"}
    steps = [3, 4, 5]
    frozen = FROZEN if variant.startswith("frozen") else ()
    said = "5 parameters (105 elements; 2 without optimizer state (frozen, or never stepped))" in output
    assert said == bool(frozen), output
    if variant.startswith("accelerate"):  # on CPU its state says 1 process: both ranks wrote random_states_0.pkl
        assert "RNG streams not carried: random_states_0.pkl cover processes 0 of a 2-rank save" in output, output
    scheduler_steps = expected.get("scheduler_steps_per_step", 0)
    if scheduler_steps:  # a torch LambdaLR Accelerate saved beside the tag folder (scheduler.bin): carried
        assert "LR scheduler state carried: lr_scheduler from scheduler.bin" in output, output
        assert manifest.extra["stateful"]["lr_scheduler"]["last_epoch"] == 3 * scheduler_steps
    if frozen:  # carried as parameters without optimizer state, as the engine saves its own frozen ones
        assert {n for n in frozen if n in manifest.tensors and manifest.tensors[n].role == "param"} == set(frozen)
        assert not [t for t in manifest.tensors.values() if t.param in frozen]
    got = run_ranks(_resume, 2, path=str(out), stage=expected["stage"], steps=steps, bf16=bf16, frozen=frozen,
                    scheduler_steps=scheduler_steps, init_process_group=False)[0]
    assert got["global_steps"] == 6
    assert {k: got["client"][k] for k in expected["client_state"]} == expected["client_state"]
    if variant == "frozen_universal_stage3":
        # DeepSpeed's own load_universal restores only what its optimizer holds (engine.py skips the
        # module state dict then), so its resume starts from fresh frozen weights; the import
        # carries them and continues as the uninterrupted run did.
        assert expected["losses_resumed"] != pytest.approx(expected["losses_after"], rel=1e-3)
        assert got["losses"] == pytest.approx(expected["losses_after"], rel=1e-5), (got["losses"], expected)
        return
    assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5), (got["losses"], expected)


def test_fp16_loss_scaling_resumes_where_deepspeed_left_it(tmp_path):
    """fp16 with DeepSpeed's dynamic loss scaling (interop_model.FP16): DeepSpeed grows the scale
    at the first step after the save and skips the next two (overflows). The import carries the
    scale, the hysteresis left and the good steps since the last overflow, so the resume skips the
    same steps and ends at the same scale; its losses equal DeepSpeed's to fp16's resolution (the
    fp32 step differs in last bits, which can round one fp16 value differently)."""
    expected = json.loads((FIXTURES / "fp16" / "expected.json").read_text())
    out = tmp_path / "imported"
    _import(FIXTURES / "fp16", out)
    _, manifest = open_checkpoint(str(out))
    assert manifest.extra["engine"]["loss_scaler"] == {"scale": 2.0 ** 15, "good_steps": 3, "hysteresis_left": 2}
    got = run_ranks(_resume, 2, path=str(out), stage=2, steps=[3, 4, 5], fp16=FP16, init_process_group=False)[0]
    assert got["skipped_steps"] == expected["skipped_steps"] == 2
    assert got["loss_scale"] == expected["loss_scale"]
    # a resume that restarted the window applied step 4 and took 4.498 at step 5, not 4.611
    assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-3), (got["losses"], expected)


@pytest.mark.parametrize("variant", ["stage3_subgroups", "universal_stage3_subgroups"])
def test_stage_3_flat_groups_cut_by_sub_group_size_come_back_as_their_param_groups(tmp_path, variant):
    """Stage 3 cuts a param group's partition into flat groups of `sub_group_size` elements
    (DeepSpeed's default is 1e9: a rank's share of a 70B model on 8 ranks is cut in nine).
    param_shapes then lists the flat groups, and the optimizer's param groups name theirs by
    index. The import failed on the list index (per-rank save) or refused the group counts
    (universal); it puts them back together, each param group with its own hyperparameters."""
    expected = json.loads((FIXTURES / variant / "expected.json").read_text())
    out = tmp_path / "imported"
    _import(FIXTURES / variant, out)
    _, manifest = open_checkpoint(str(out))
    groups = manifest.optimizer["param_groups"]
    assert [(g["params"], g["weight_decay"]) for g in groups] == [
        (["emb.weight", "fc.weight"], WEIGHT_DECAY), (["norm.weight", "norm.bias", "fc.bias"], 0.0)]
    got = run_ranks(_resume, 2, path=str(out), stage=3, steps=[3, 4, 5], groups=True, init_process_group=False)[0]
    if variant.startswith("universal"):
        # DeepSpeed's own stage-3 load_universal gives every param group the first one's
        # hyperparameters (stage3.py, _load_universal_checkpoint), so its resume decayed the
        # no-decay group and drifted; the import continues as the uninterrupted run did
        assert expected["losses_resumed"] != pytest.approx(expected["losses_after"], rel=1e-4)
        assert got["losses"] == pytest.approx(expected["losses_after"], rel=1e-5), (got["losses"], expected)
        return
    assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5), (got["losses"], expected)


def test_flat_groups_no_param_group_claims_are_refused(tmp_path):
    from zeroshard.interop.deepspeed_common import group_members

    shapes = [{"a": (2,)}, {"b": (3,)}, {"c": (1,)}]
    assert group_members("x", shapes, [{"params": [0, 1]}, {"params": [2]}]) == [{"a": (2,), "b": (3,)},
                                                                              {"c": (1,)}]
    for bad in ([{"params": [0]}, {"params": [2]}], [{"params": [0, 1]}, {"params": [1, 2]}],
                [{"params": [0, 1]}, {"params": ["2"]}], [{"lr": 1.0}, {"lr": 2.0}]):
        with pytest.raises(CheckpointError, match="do not say which of them each holds"):
            group_members("x", shapes, bad)


@pytest.mark.slow
def test_offload_int_step_is_written_as_torchs_tensor_step(tmp_path):
    """DeepSpeedCPUAdam keeps `step` as a Python int; torch's AdamW needs a 0-d float tensor."""
    pytest.importorskip("deepspeed", reason="unpickling the raw file needs DeepSpeed (dev.sh test --all installs it)")
    raw = torch.load(FIXTURES / "offload" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     weights_only=False)
    assert type(raw["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"]) is int  # the real form
    imp = read_deepspeed(str(FIXTURES / "offload"))
    assert all(s["step"] == {"dtype": "F32", "value": 3.0} for s in imp.scalar_state.values())


def test_hf_trainer_folders_carry_trainer_state_into_client_state(tmp_path):
    """checkpoint-N (a save_dir) and the run folder holding one checkpoint-N both import; the
    Trainer's trainer_state.json rides along under client_state["hf_trainer_state"]."""
    state = json.loads((FIXTURES / "hf" / "checkpoint-3" / "trainer_state.json").read_text())
    for src in (FIXTURES / "hf", FIXTURES / "hf" / "checkpoint-3", FIXTURES / "hf" / "checkpoint-3" / "global_step3"):
        out = tmp_path / src.name
        _import(src, out)
        manifest = open_checkpoint(str(out))[1]
        assert manifest.client_state == {"hf_trainer_state": state} and state["global_step"] == 3


@pytest.mark.parametrize("stage", [2, 3])
def test_universal_checkpoint_equals_the_per_rank_save_it_came_from(stage):
    """ds_to_universal of a stage-2/3 run (the same seeds and data as the stage2/3 fixture) reads
    back to exactly the values of the per-rank save; by root (latest_universal) or by folder."""
    per_rank = read_deepspeed(str(FIXTURES / f"stage{stage}"))
    variant = FIXTURES / ("universal" if stage == 2 else "universal_stage3")
    for src in (variant, variant / "global_step3_universal"):
        uni = read_deepspeed(str(src))
        assert list(uni.params) == list(per_rank.params) and uni.aliases == per_rank.aliases
        for name, tensor in per_rank.params.items():
            assert torch.equal(uni.params[name], tensor), name
            assert sorted(uni.optimizer_state[name]) == ["exp_avg", "exp_avg_sq"]
            for key, moment in per_rank.optimizer_state[name].items():
                assert torch.equal(uni.optimizer_state[name][key], moment), (name, key)
            assert uni.scalar_state[name] == per_rank.scalar_state[name] == {"step": {"dtype": "F32", "value": 3.0}}
        assert uni.param_groups == per_rank.param_groups and uni.client_state == per_rank.client_state
        assert (uni.global_steps, uni.zero_stage, uni.world_size) == (3, stage, 2)
        assert torch.equal(uni.buffers["scale"], per_rank.buffers["scale"])


def test_import_reshards_to_another_world_size(tmp_path):
    expected = json.loads((FIXTURES / "stage3" / "expected.json").read_text())
    out = tmp_path / "w3"
    _import(FIXTURES / "stage3", out, "--world", "3")
    assert open_checkpoint(str(out))[1].world_size == 3
    got = run_ranks(_resume, 2, path=str(out), stage=2, steps=[3, 4, 5], init_process_group=False)[0]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got["losses"], expected["losses_resumed"]))


def test_imported_values_match_deepspeed_partitions():
    """Stage 1 and stage 3 cut the same training run: the same fp32 weights and moments."""
    one, three = read_deepspeed(str(FIXTURES / "stage1")), read_deepspeed(str(FIXTURES / "stage3"))
    assert list(one.params) == list(three.params) == ["emb.weight", "norm.weight", "norm.bias", "fc.weight", "fc.bias"]
    for name in one.params:
        torch.testing.assert_close(one.params[name], three.params[name], rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(one.optimizer_state[name][key], three.optimizer_state[name][key],
                                       rtol=1e-5, atol=1e-9)
    assert one.scalar_state["fc.bias"]["step"]["value"] == 3
    assert one.param_groups[0]["lr"] == 1e-2 and one.param_groups[0]["betas"] == [0.9, 0.95]
    assert one.buffers["scale"].tolist() == [0.5] * 5


def _hostile_copy(tmp_path: Path, victim: str) -> tuple[Path, Path]:
    side = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {side}",))

    folder = tmp_path / "evil"
    shutil.copytree(FIXTURES / "stage2" / "global_step3", folder)
    torch.save({"optimizer_state_dict": {"x": Evil()}}, folder / victim)
    return folder, side


@pytest.mark.parametrize("victim", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
def test_hostile_pickle_is_refused_and_never_runs(tmp_path, victim):
    folder, side = _hostile_copy(tmp_path, victim)
    with pytest.raises(CheckpointError) as err:
        read_deepspeed(str(folder))
    message = str(err.value)
    assert victim in message and "refused" in message and "\n" not in message
    assert not side.exists()
    result = CliRunner().invoke(main, ["import", "deepspeed", str(folder), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1 and victim in result.output and len(result.output.strip().splitlines()) == 1
    assert not side.exists() and not (tmp_path / "out" / "zeroshard.json").exists()


def test_not_a_deepspeed_checkpoint(tmp_path):
    result = CliRunner().invoke(main, ["import", "deepspeed", str(tmp_path), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1 and "not a DeepSpeed checkpoint" in result.output
    # weights only (a Trainer save_only_model checkpoint): the way to start from them is named, and works
    src = tmp_path / "checkpoint-3"
    src.mkdir()
    shutil.copy(FIXTURES / "hf_trainer" / "checkpoint-3" / "model.safetensors", src)
    result = CliRunner().invoke(main, ["import", "deepspeed", str(src), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1 and "model weights (a Trainer checkpoint" in result.output, result.output
    assert "fresh optimizer" not in result.output
    command = result.output.split("`")[1].replace("OUT", str(tmp_path / "sharded")).replace("N", "2").split()
    assert command[:2] == ["zeroshard", "shard"]
    assert CliRunner().invoke(main, [*command[1:], "-q"]).exit_code == 0
    torch.save({"state": {}, "param_groups": []}, src / "optimizer.pt")  # the Trainer's without DeepSpeed
    result = CliRunner().invoke(main, ["import", "deepspeed", str(src), str(tmp_path / "out"), "-q"])
    assert f"Trainer checkpoint without DeepSpeed (model weights and optimizer.pt): `zeroshard import dcp {src} OUT`" \
        in result.output, result.output


def test_interop_is_toolkit_side():
    """The importers never import the training core, and torch only when a command runs."""
    code = ("import sys, zeroshard.cli, zeroshard.interop.deepspeed_ckpt, zeroshard.interop.write, "
            "zeroshard.interop.deepspeed_common, zeroshard.interop.deepspeed_universal, "
            "zeroshard.interop.torch_pickle, zeroshard.interop.dcp_import, zeroshard.interop.dcp_export; "
            "print('\\n'.join(sys.modules))")
    modules = set(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                 text=True).stdout.split())
    assert "torch" not in modules
    assert not {m for m in modules if m.startswith(("zeroshard.engine", "zeroshard.checkpointing"))}


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_fresh_deepspeed_checkpoints_import_and_resume(tmp_path):
    """With DeepSpeed installed, regenerate the fixtures with this DeepSpeed and check them too."""
    tool = Path(__file__).parents[1] / "tools" / "make_deepspeed_fixtures.py"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(tool), str(tmp_path / "fresh"), "stage1", "stage2", "stage3"],
                          capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for stage in (1, 2, 3):
        expected = json.loads((tmp_path / "fresh" / f"stage{stage}" / "expected.json").read_text())
        assert expected["losses_resumed"] == pytest.approx(expected["losses_after"], rel=1e-6)
        out = tmp_path / f"imported{stage}"
        _import(tmp_path / "fresh" / f"stage{stage}", out)
        got = run_ranks(_resume, 2, path=str(out), stage=stage, steps=[3, 4, 5], init_process_group=False)[0]
        assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
@pytest.mark.skipif(os.environ.get("ZEROSHARD_SLOW_TESTS") != "1",
                    reason="8 min on 2 cores (builds DeepSpeed's CPU Adam op): set ZEROSHARD_SLOW_TESTS=1")
@pytest.mark.timeout(1200)
def test_fresh_deepspeed_variants_import_and_resume(tmp_path):
    """With DeepSpeed installed, regenerate the variant fixtures (offload builds DeepSpeed's CPU
    Adam op with g++ on first use) and check them as the committed ones are checked. Opt-in: the
    committed fixtures were made by the same DeepSpeed 0.19.8 and are checked on every run."""
    tool = Path(__file__).parents[1] / "tools" / "make_deepspeed_fixtures.py"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(tool), str(tmp_path / "fresh"), *VARIANTS], capture_output=True,
                          text=True, timeout=1100, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for variant, (src, bf16) in VARIANTS.items():
        expected = json.loads((tmp_path / "fresh" / variant / "expected.json").read_text())
        assert expected["losses_resumed"] == pytest.approx(expected["losses_after"], rel=1e-6)
        out = tmp_path / f"imported-{variant}"
        _import(tmp_path / "fresh" / variant / src, out)
        got = run_ranks(_resume, 2, path=str(out), stage=expected["stage"], steps=[3, 4, 5], bf16=bf16,
                        frozen=FROZEN if variant.startswith("frozen") else (),
                        scheduler_steps=expected.get("scheduler_steps_per_step", 0), init_process_group=False)[0]
        assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5), variant


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
@pytest.mark.parametrize("stage", [1, 2, 3, "offload", "bf16_stage2", "bf16_stage3", "hf/checkpoint-3", "frozen_stage2",
                                   "frozen_stage3"])
def test_weights_equal_deepspeeds_own_zero_to_fp32(stage):
    """DeepSpeed's consolidation (zero_to_fp32) and our import agree on every weight, exactly."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = FIXTURES / (stage if isinstance(stage, str) else f"stage{stage}")
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(src))
    ours = read_deepspeed(str(src))
    mine = {**ours.params, **ours.buffers, **{a: ours.params[t] for a, t in ours.aliases.items()}}
    assert sorted(mine) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(mine[name].float(), tensor.float()), name


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_stage_1_frozen_parameters_come_from_the_module_state_dict():
    """At stage 1 DeepSpeed records frozen parameters nowhere but the module state dict (its own
    zero_to_fp32 leaves them out): the import carries them with the values saved there."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    src = FIXTURES / "frozen_stage1"
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(src))
    ours = read_deepspeed(str(src))
    assert set(FROZEN).isdisjoint(theirs) and set(FROZEN) <= set(ours.params)
    module = torch.load(src / "global_step3" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    for name in FROZEN:
        assert torch.equal(ours.params[name].float(), module[name].float()), name
    for name, tensor in theirs.items():
        mine = ours.params.get(name, ours.buffers.get(name))
        mine = ours.params[ours.aliases[name]] if mine is None else mine
        assert torch.equal(mine.float(), tensor.float()), name


def test_a_stage_3_import_without_a_ranks_slice_of_a_frozen_parameter_is_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "frozen_stage3", src)
    (src / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    result = CliRunner().invoke(main, ["import", "deepspeed", str(src), str(tmp_path / "out"), "-q"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in result.output and "frozen" in result.output, result.output
    assert not (tmp_path / "out" / "zeroshard.json").exists()


@pytest.mark.parametrize("extra, kind", [("layer_0_expert_1_mp_rank_00_model_states.pt", "mixture-of-experts"),
                                         ("expp_rank_0_mp_rank_00_optim_states.pt", "mixture-of-experts"),
                                         ("layer_01-model_00-model_states.pt", "pipeline-parallel")])
def test_layouts_with_weights_in_files_not_read_are_refused(tmp_path, extra, kind):
    """MoE experts and pipeline stages keep weights in files the import does not read: refused
    by name, never imported without them."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "stage2", src)
    shutil.copy(src / "global_step3" / "mp_rank_00_model_states.pt", src / "global_step3" / extra)
    result = CliRunner().invoke(main, ["import", "deepspeed", str(src), str(tmp_path / "out"), "-q"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert extra in result.output and f"a {kind} DeepSpeed checkpoint" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_an_elastic_checkpoint_is_refused_by_name(tmp_path):
    """DeepSpeed's `elastic_checkpoint` saves optimizer state per param group, padding dropped,
    not torch's state_dict (tests/data/deepspeed/elastic_stage2, written by DeepSpeed 0.19.8,
    which cannot resume it with a torch optimizer either): refused naming the option."""
    assert json.loads((FIXTURES / "elastic_stage2" / "expected.json").read_text())["refused"]
    result = CliRunner().invoke(main, ["import", "deepspeed", str(FIXTURES / "elastic_stage2"),
                                       str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in result.output
    assert "elastic_checkpoint" in result.output and "not supported" in result.output, result.output
    assert not (tmp_path / "out").exists()


class Registered:
    """An object a script registers with Accelerate's register_for_checkpointing: plain data."""

    def __init__(self, seen: int = 0) -> None:
        self.seen = seen

    def state_dict(self) -> dict:
        return {"seen": self.seen, "epochs": [1, 2]}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]


def _restore_registered(rank: int, world_size: int, path: str) -> int:
    import zeroshard

    engine = zeroshard.initialize(model=make_model(1), optimizer=make_optimizer,
                                  config={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4})
    registered = Registered()
    zeroshard.Checkpointer(engine, custom_checkpoint_0=registered).load(path)
    return registered.seen


@pytest.mark.slow
def test_accelerate_registered_objects_are_carried_and_one_holding_tensors_is_refused(tmp_path):
    """Accelerate saves what a script registered for checkpointing as custom_checkpoint_N.pkl
    beside the tag folder (accelerate.checkpointing.save_custom_state, as save_state calls it):
    plain data comes across under that name and restores into a Checkpointer's stateful object;
    an EMA copy of the model (tensors) is refused naming the file, never left out."""
    checkpointing = pytest.importorskip("accelerate.checkpointing", reason="accelerate is not installed")
    from accelerate import PartialState

    PartialState(cpu=True)  # one process, no process group: what save_custom_state's logging reads
    root = tmp_path / "acc"
    shutil.copytree(FIXTURES / "accelerate", root)
    checkpointing.save_custom_state(Registered(12), str(root), 0)
    output = _import(root, tmp_path / "out")
    assert "registered objects carried as Stateful state: custom_checkpoint_0" in output, output
    _, manifest = open_checkpoint(str(tmp_path / "out"))
    assert manifest.extra["stateful"] == {"custom_checkpoint_0": {"seen": 12, "epochs": [1, 2]}}
    assert run_ranks(_restore_registered, 1, path=str(tmp_path / "out"), init_process_group=False) == [12]

    ema = torch.optim.swa_utils.AveragedModel(make_model(0))
    checkpointing.save_custom_state(ema, str(root), 1)
    result = CliRunner().invoke(main, ["import", "deepspeed", str(root), str(tmp_path / "out2"), "-q"])
    assert result.exit_code == 1 and "custom_checkpoint_1.pkl" in result.output, result.output
    assert "holds tensors" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out2" / "zeroshard.json").exists()


def _trainer_resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, expected: dict,
                    with_scheduler: bool = True, strict: bool = True, stage: int | None = None) -> dict:
    """Resume an HF Trainer fixture's import as the Trainer's script would go on: its linear
    warmup schedule (when `with_scheduler`), 3 steps of its one repeated batch; the mean losses and
    the load's warnings."""
    import warnings

    import transformers

    import zeroshard

    engine = zeroshard.initialize(model=model, optimizer=optimizer,
                                  config={"zero_optimization": {"stage": expected["stage"] if stage is None else stage},
                                          "gradient_clipping": 1.0,
                                          "train_micro_batch_size_per_gpu": MICRO_BATCH})
    schedule = expected["scheduler"]
    scheduler = transformers.get_scheduler(schedule["name"], engine.optimizer,
                                           num_warmup_steps=schedule["num_warmup_steps"],
                                           num_training_steps=schedule["num_training_steps"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(path, lr_scheduler=scheduler if with_scheduler else None, strict=strict)
    losses = []
    tokens, labels = trainer_batch()
    for _ in range(3):
        out = engine(input_ids=tokens, labels=labels)  # as the Trainer calls models
        loss = out["loss"]
        engine.backward(loss)
        engine.step()
        for _ in range(expected["scheduler_steps_per_step"]):
            scheduler.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return {"losses": losses, "warnings": [str(w.message) for w in caught]}


def _resume_trainer(rank: int, world_size: int, path: str, trainers_groups: bool) -> dict:
    """TinyTied with the Trainer's AdamW groups (no weight decay on biases and LayerNorm), or one
    plain group (and then no scheduler)."""
    expected = json.loads((FIXTURES / "hf_trainer" / "expected.json").read_text())
    torch.manual_seed(1)
    model = TrainerTied()  # make_model(1)'s weights, called as the Trainer calls it
    named = dict(model.named_parameters())
    decay = [named["emb.weight"], named["fc.weight"]]
    rest = [named["norm.weight"], named["norm.bias"], named["fc.bias"]]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": rest, "weight_decay": 0.0}] if trainers_groups else model.parameters(),
                                  lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return _trainer_resume(model, optimizer, path, expected, with_scheduler=trainers_groups)


@pytest.mark.slow
def test_hf_trainer_checkpoint_resumes_with_the_trainers_own_losses(tmp_path):
    """Hugging Face's Trainer driving DeepSpeed ZeRO 2 (tests/data/deepspeed/hf_trainer, written by
    transformers 5.24 itself): its run folder imports with the Trainer's schedule (scheduler.pt)
    and two param groups, resumes with the Trainer's own next losses, and equals the weights the
    Trainer saved itself (model.safetensors). A resume with one plain group is told what it keeps."""
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
    from safetensors.torch import load_file

    import zeroshard

    expected = json.loads((FIXTURES / "hf_trainer" / "expected.json").read_text())
    out = tmp_path / "imported"
    output = _import(FIXTURES / "hf_trainer", out)  # the run folder: its one checkpoint-3
    assert "LR scheduler state carried: lr_scheduler from scheduler.pt" in output, output
    assert "not imported (pickles are not read): training_args.bin" in output, output
    _, manifest = open_checkpoint(str(out))
    assert [len(g["params"]) for g in manifest.optimizer["param_groups"]] == [2, 3]
    assert manifest.client_state["hf_trainer_state"]["global_step"] == 3

    theirs = load_file(str(FIXTURES / "hf_trainer" / "checkpoint-3" / "model.safetensors"))
    ours = zeroshard.load_state_dict(str(out))
    assert theirs and all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())

    got = run_ranks(_resume_trainer, 2, path=str(out), trainers_groups=True, init_process_group=False)[0]
    assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5), (got["losses"], expected)
    assert not got["warnings"], got["warnings"]
    plain = run_ranks(_resume_trainer, 2, path=str(out), trainers_groups=False, init_process_group=False)[0]
    assert any("param groups (1: " in w and "are not the saved ones (2: " in w and "weight_decay 0.0" in w
               for w in plain["warnings"]), plain["warnings"]
    assert any("saved state of 'lr_scheduler' is not restored" in w for w in plain["warnings"]), plain["warnings"]


def _resume_trainer_ddp(rank: int, world_size: int, path: str, stage: int) -> dict:
    """The Trainer's Llama from other weights (seed 1), with the Trainer's own AdamW groups."""
    import transformers

    from interop_model import trainer_llama

    expected = json.loads((FIXTURES / "hf_trainer_ddp" / "expected.json").read_text())
    model = trainer_llama(1)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return _trainer_resume(model, optimizer, path, expected, stage=stage)


def test_hf_trainer_checkpoint_without_deepspeed_imports_with_its_optimizer_state(tmp_path):
    """Hugging Face's Trainer with DDP alone (tests/data/deepspeed/hf_trainer_ddp, written by
    transformers 5.24 on a two-layer Llama): optimizer.pt keys Adam's state by parameter index,
    and q/o, k/v, gate/up share shapes, so only the model class's order says which is which
    (zeroshard/interop/trainer_ddp.py). The import gives each state to its parameter, carries the
    schedule and RNG streams, and resumes with the Trainer's own next losses at stages 0 and 3.
    A config of another transformers version, or of another model, is refused, writing nothing."""
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
    from safetensors.torch import load_file

    expected = json.loads((FIXTURES / "hf_trainer_ddp" / "expected.json").read_text())
    src = FIXTURES / "hf_trainer_ddp" / "checkpoint-3"
    out = tmp_path / "imported"
    listed = CliRunner().invoke(main, ["ls", str(src.parent)]).output  # ls names the command to run
    assert f"FOREIGN: a Hugging Face Trainer checkpoint (no DeepSpeed or FSDP): `zeroshard import dcp {src} OUT`" \
        in listed, listed
    result = CliRunner().invoke(main, ["import", "dcp", str(src), str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert "Hugging Face Trainer (no DeepSpeed or FSDP) layout" in result.output
    assert "LR scheduler state carried: lr_scheduler from scheduler.pt" in result.output
    assert "RNG streams of the 2 ranks read" in result.output
    theirs = load_file(str(src / "model.safetensors"))
    ours = zeroshard_load(out)
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())
    saved = torch.load(src / "optimizer.pt", weights_only=True)  # the test may read the pickle; zeroshard never does
    assert [len(g["params"]) for g in saved["param_groups"]] == [15, 5]
    import zeroshard

    layer = "model.layers.0."  # index 1 is its q_proj, index 4 its o_proj: both 8 x 8
    with zeroshard.open_tensors(str(out), roles=None) as ckpt:
        for index, name in ((1, f"{layer}self_attn.q_proj.weight"), (4, f"{layer}self_attn.o_proj.weight"),
                            (15, f"{layer}input_layernorm.weight")):
            assert torch.equal(ckpt[f"optimizer/exp_avg/{name}"], saved["state"][index]["exp_avg"]), name
    for stage in (0, 3):
        got = run_ranks(_resume_trainer_ddp, 2, path=str(out), stage=stage, init_process_group=False)[0]
        assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5), (stage, got, expected)
        assert not got["warnings"], got["warnings"]

    config = json.loads((src / "config.json").read_text())
    for change, needle in (({"transformers_version": "4.57.0"}, "saved by transformers 4.57.0"),
                           ({"num_hidden_layers": 1}, "param groups of [15, 5] parameters, where the Trainer's "
                                                      "default optimizer has [8, 3]")):
        edited = tmp_path / "edited"
        shutil.rmtree(edited, ignore_errors=True)
        shutil.copytree(src, edited)
        (edited / "config.json").write_text(json.dumps(dict(config, **change)))
        result = CliRunner().invoke(main, ["import", "dcp", str(edited), str(tmp_path / "refused"), "-q"])
        assert result.exit_code == 1 and needle in result.output, result.output
        assert "zeroshard shard" in result.output and not (tmp_path / "refused").exists()
    shutil.rmtree(edited)
    shutil.copytree(src, edited)  # an 8-bit optimizer's state: shaped as the parameters, but not Adam's moments
    for per_param in saved["state"].values():
        per_param["state1"] = per_param.pop("exp_avg")
    torch.save(saved, edited / "optimizer.pt")
    result = CliRunner().invoke(main, ["import", "dcp", str(edited), str(tmp_path / "refused"), "-q"])
    assert result.exit_code == 1 and "state state1 of parameter index 0: not torch's Adam/AdamW" in result.output
    assert not (tmp_path / "refused").exists()


def _resume_lora(rank: int, world_size: int, path: str, variant: str) -> dict:
    """Resume the LoRA import as a PEFT script would: the base from its pretrained weights (seed
    0), fresh adapters (seed 1) the load must overwrite, AdamW over the adapters, strict=False."""
    from peft import LoraConfig, get_peft_model

    expected = json.loads((FIXTURES / variant / "expected.json").read_text())
    torch.manual_seed(0)
    inner = TrainerTied()
    torch.manual_seed(1)
    model = get_peft_model(inner, LoraConfig(**expected["lora"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return _trainer_resume(model, optimizer, path, expected, strict=False)


def _import_lora(variant: str, out: Path) -> tuple[dict, str]:
    expected = json.loads((FIXTURES / variant / "expected.json").read_text())
    output = _import(FIXTURES / variant, out)
    assert "saved with exclude_frozen_parameters" in output, output
    return expected, output


@pytest.mark.parametrize("variant", ["hf_trainer_lora", "hf_trainer_lora_stage3"])
def test_hf_trainer_peft_lora_checkpoint_imports(tmp_path, variant):
    """The HF Trainer saves a PEFT model with DeepSpeed's exclude_frozen_parameters: only the
    adapters are in DeepSpeed's files, plus the tied head (a copy of the frozen embedding the
    exclusion misses). The import failed on that copy; it now carries it as the embedding and
    says what the checkpoint lacks (PEFT itself is needed only to resume: the next test)."""
    out = tmp_path / "imported"
    expected, output = _import_lora(variant, out)
    _, manifest = open_checkpoint(str(out))
    if expected["stage"] == 2:  # stage 3's module state dict holds empty placeholders: no copy to recover
        assert "base_model.model.emb.weight (from its tied copy base_model.model.head.weight)" in output, output
        assert manifest.aliases == {"base_model.model.head.weight": "base_model.model.emb.weight"}
        torch.manual_seed(0)
        assert torch.equal(zeroshard_load(out)["base_model.model.emb.weight"], TrainerTied().emb.weight.detach())


@pytest.mark.slow  # PEFT (and the Accelerate it needs) are set up by tools/dev.sh test --all only
@pytest.mark.parametrize("variant", ["hf_trainer_lora", "hf_trainer_lora_stage3"])
def test_hf_trainer_peft_lora_checkpoint_resumes_with_the_trainers_losses(tmp_path, variant):
    """The LoRA import resumes (strict=False, the base from its pretrained weights) with the
    Trainer's own next losses."""
    pytest.importorskip("peft", reason="peft is not installed (tools/dev.sh test --all installs it)")
    out = tmp_path / "imported"
    expected, _ = _import_lora(variant, out)
    got = run_ranks(_resume_lora, 2, path=str(out), variant=variant, init_process_group=False)[0]
    assert got["losses"] == pytest.approx(expected["losses_resumed"], rel=1e-5), (got["losses"], expected)
    assert expected["losses_resumed"] == pytest.approx(expected["losses_after"], rel=1e-6)
    assert any("not in the checkpoint keep their values" in w and "fc.base_layer.weight" in w
               for w in got["warnings"]), got["warnings"]


def zeroshard_load(path: Path) -> dict:
    import zeroshard

    return zeroshard.load_state_dict(str(path))


def _draws_after_load(rank: int, world_size: int, path: str) -> dict:
    """What this rank's torch, Python and NumPy generators draw right after engine.load_checkpoint."""
    import random

    import numpy as np

    import zeroshard

    engine = zeroshard.initialize(model=make_model(1), optimizer=make_optimizer,
                                  config={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4})
    engine.load_checkpoint(path)
    return {"torch": torch.rand(3).tolist(), "python": random.random(), "numpy": np.random.rand(2).tolist()}


def test_hf_trainer_rng_streams_come_back_at_the_same_world_size(tmp_path):
    """The Trainer's rng_state_{r}.pth (torch, Python, NumPy streams of process r) become rank r's
    RNG state: after engine.load_checkpoint each rank draws what the Trainer's resume would; at
    another world size they are not written, and the output says so."""
    import random

    import numpy as np

    out = tmp_path / "imported"
    output = _import(FIXTURES / "hf_trainer", out)
    assert "RNG streams of the 2 ranks read (rng_state_0.pth, ...)" in output, output
    shown = CliRunner().invoke(main, ["inspect", str(out)]).output  # what an import carried, later too
    assert "state        lr_scheduler, per-rank state of 2 rank(s)" in shown, shown
    assert "imported     from deepspeed:" in shown and "  note: RNG streams of the 2 ranks read" in shown, shown
    got = run_ranks(_draws_after_load, 2, path=str(out), init_process_group=False)
    for rank in range(2):  # the Trainer's own file, read in full (a trusted fixture), set as its resume does
        saved = torch.load(FIXTURES / "hf_trainer" / "checkpoint-3" / f"rng_state_{rank}.pth", weights_only=False)
        torch.set_rng_state(saved["cpu"])
        random.setstate(saved["python"])
        np.random.set_state(saved["numpy"])
        assert got[rank] == {"torch": torch.rand(3).tolist(), "python": random.random(),
                             "numpy": np.random.rand(2).tolist()}, rank
    output = _import(FIXTURES / "hf_trainer", tmp_path / "three", "--world", "3")
    assert "the per-rank state (RNG streams) of the source's 2 ranks is not written: it means nothing at 3" in output
    _, manifest = open_checkpoint(str(tmp_path / "three"))
    assert not [n for n in manifest.tensors if n.startswith("rank-state/")]
