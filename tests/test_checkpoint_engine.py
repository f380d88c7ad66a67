"""Engine checkpoints: exact resume at the same and other world sizes and stages, offline reshard,
crash safety, failing destinations, async save, keep_last, strict loading, pretrained weights,
and the toolkit reading what the engine wrote.

Every run trains TinyGPT (tied embeddings, a frozen parameter, a module called twice, a
3-element parameter) with AdamW, gradient clipping and an LR scheduler, on gloo CPU ranks.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

import zeroshard

from distributed import RankError, run_ranks
from test_engine_models import assert_losses_close, assert_state_close, batches, build_optimizer, make_model, train_step

TIER = "mixed"  # docs/TESTING.md

K, GLOBAL_BATCH, GAS = 2, 24, 2  # the global batch divides evenly at world sizes 2, 3 and 4


def run(rank: int, world: int, *, stage: int, steps: int, ckpt: str | None = None, save_at: tuple[int, ...] = (),
        resume: str | None = None, async_save: bool = False, keep_last: int | None = None,
        kill_in_save: int | None = None, model_kwargs: dict | None = None, strict: bool = True) -> dict[str, Any]:
    """Train `steps` steps (resuming first if asked), saving after each step in `save_at`."""
    model = make_model(**(model_kwargs or {}))
    engine = zeroshard.initialize(model=model, optimizer=build_optimizer("adamw", model), config={
        "zero_optimization": {"stage": stage}, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5})
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.7)
    out: dict[str, Any] = {"losses": [], "errors": []}
    start = 0
    if resume:
        client = engine.load_checkpoint(resume, lr_scheduler=sched, strict=strict)
        start = client["next_step"]
        out["rng_after_load"] = torch.rand(3)
    for step, batch in enumerate(batches(steps, GLOBAL_BATCH)):
        if step < start:
            continue
        out["losses"].append(train_step(engine, batch, rank, world, GAS))
        sched.step()
        if step + 1 in save_at:
            torch.manual_seed(1000 + rank)  # an RNG state worth restoring
            if kill_in_save is not None and step + 1 == save_at[-1] and rank == kill_in_save:
                _die_while_writing()
            try:
                engine.save_checkpoint(ckpt, client_state={"next_step": step + 1}, lr_scheduler=sched,
                                       async_save=async_save, keep_last=keep_last)
                if async_save:
                    engine.wait()
            except zeroshard.CheckpointSaveError as exc:
                out["errors"].append(str(exc))
            out[f"state_at_{step + 1}"] = engine.full_state_dict()
            out[f"rng_at_{step + 1}"] = torch.rand(3)
    out["state"] = engine.full_state_dict()
    out["lr"] = engine.optimizer.param_groups[0]["lr"]
    out["global_steps"] = engine.global_steps
    return out


def _die_while_writing() -> None:
    """SIGKILL this rank once it has written part of its shard (a preempted node)."""
    from zeroshard.storage import location

    original = location.AtomicWriter.write

    def write(self, data):
        original(self, bytes(memoryview(data).cast("B")[:10]))
        os.kill(os.getpid(), signal.SIGKILL)

    location.AtomicWriter.write = write


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict[str, Any]:
    """The uninterrupted world-4 stage-3 run to 2K steps, checkpointing at K."""
    ckpt = str(tmp_path_factory.mktemp("w4") / "run")
    result = run_ranks(run, 4, timeout=240, stage=3, steps=2 * K, ckpt=ckpt, save_at=(K,))
    return {"ckpt": ckpt, "ranks": result, "rank0": result[0]}


@pytest.mark.slow
def test_resume_at_same_world_and_stage_is_exact(world4):
    resumed = run_ranks(run, 4, timeout=240, stage=3, steps=2 * K, resume=world4["ckpt"])
    ref = world4["rank0"]
    assert_losses_close(resumed[0]["losses"], ref["losses"][K:], 1e-6)
    assert_state_close(resumed[0]["state"], ref["state"], 1e-6)
    assert resumed[0]["lr"] == ref["lr"] and resumed[0]["global_steps"] == ref["global_steps"]
    for rank in range(4):  # each rank's RNG state came back
        assert torch.equal(resumed[rank]["rng_after_load"], world4["ranks"][rank][f"rng_at_{K}"])


@pytest.mark.slow
def test_offline_reshard_then_resume_at_world2_stage2(world4, tmp_path):
    from zeroshard.toolkit.reshard import reshard

    reshard(world4["ckpt"], 2, str(tmp_path / "w2"))
    resumed = run_ranks(run, 2, timeout=240, stage=2, steps=2 * K, resume=str(tmp_path / "w2"))
    assert_losses_close(resumed[0]["losses"], world4["rank0"]["losses"][K:], 1e-5)
    assert_state_close(resumed[0]["state"], world4["rank0"]["state"], 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("ranks_here", ["100000", "1"], ids=["hashed-inline", "hashed-behind"])
def test_load_time_reshard_at_world3_stage1(world4, ranks_here):
    """Also with the load's hashing on a thread behind its reads (a core to spare: one rank per
    node, as LOCAL_WORLD_SIZE says; checkpointing.load.spare_core)."""
    resumed = run_ranks(run, 3, timeout=240, stage=1, steps=2 * K, resume=world4["ckpt"],
                        env={"LOCAL_WORLD_SIZE": ranks_here})
    assert_losses_close(resumed[0]["losses"], world4["rank0"]["losses"][K:], 1e-5)
    assert_state_close(resumed[0]["state"], world4["rank0"]["state"], 1e-5)


@pytest.mark.slow
def test_consolidate_equals_full_state_dict_and_loads_strict(world4, tmp_path):
    from safetensors.torch import load_file

    from zeroshard.toolkit.consolidate import consolidate
    from zeroshard.toolkit.verify import verify

    assert verify(world4["ckpt"]).ok
    consolidate(world4["ckpt"], str(tmp_path / "model.safetensors"))
    weights = load_file(str(tmp_path / "model.safetensors"))
    live = world4["rank0"][f"state_at_{K}"]
    assert sorted(weights) == sorted(live)
    for name, value in live.items():
        assert weights[name].dtype == value.dtype and torch.equal(weights[name], value), name
    plain = make_model()
    plain.load_state_dict(weights, strict=True)


@pytest.mark.slow
def test_inspect_reads_engine_checkpoint(world4):
    from zeroshard.toolkit.inspect import inspect_checkpoint

    info = inspect_checkpoint(world4["ckpt"])
    assert info["world_size"] == 4 and info["zero_stage"] == 3 and info["step"] == K
    assert info["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert set(info["optimizer"]["states"]) == {"exp_avg", "exp_avg_sq"}
    assert info["aliases"] == {"head.weight": "tok.weight"}


@pytest.mark.slow
def test_killed_rank_mid_save_leaves_previous_checkpoint(tmp_path):
    from zeroshard.format import open_checkpoint
    from zeroshard.toolkit.verify import verify

    ckpt = str(tmp_path / "run")
    with pytest.raises(RankError, match="died|exit code"):
        run_ranks(run, 2, timeout=120, fresh=True, stage=3, steps=3, ckpt=ckpt, save_at=(1, 2), kill_in_save=1)
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-00000001"
    assert not (tmp_path / "run" / "step-00000002" / "zeroshard.json").exists()
    assert verify(ckpt).ok
    location, manifest = open_checkpoint(ckpt)
    assert manifest.step == 1
    resumed = run_ranks(run, 2, timeout=120, stage=3, steps=3, resume=ckpt)
    reference = run_ranks(run, 2, timeout=120, stage=3, steps=3)
    assert_losses_close(resumed[0]["losses"], reference[0]["losses"][1:], 1e-6)


@pytest.mark.parametrize("async_save", [False, True])
def test_failing_destination_raises_on_every_rank_and_keeps_latest(tmp_path, async_save):
    ckpt = tmp_path / "run"
    (ckpt / "step-00000002" / "rank-00001-of-00002.safetensors").mkdir(parents=True)  # rank 1 cannot write
    result = run_ranks(run, 2, timeout=120, stage=2, steps=2, ckpt=str(ckpt), save_at=(1, 2), async_save=async_save)
    for rank in range(2):
        assert len(result[rank]["errors"]) == 1, result[rank]["errors"]
        assert "rank 1" in result[rank]["errors"][0] and "nothing committed" in result[rank]["errors"][0]
    assert (ckpt / "latest").read_text().strip() == "step-00000001"
    assert not (ckpt / "step-00000002" / "zeroshard.json").exists()
    # rank 0 wrote its file and removed it when rank 1 failed; what is not the save's stays
    assert [p.name for p in (ckpt / "step-00000002").iterdir()] == ["rank-00001-of-00002.safetensors"]
    assert (ckpt / "step-00000002" / "rank-00001-of-00002.safetensors").is_dir()


def test_async_save_matches_sync_and_keep_last_prunes(tmp_path):
    sync = run_ranks(run, 2, timeout=120, stage=3, steps=4, ckpt=str(tmp_path / "sync"), save_at=(1, 2, 3, 4))
    asyn = run_ranks(run, 2, timeout=120, stage=3, steps=4, ckpt=str(tmp_path / "async"), save_at=(1, 2, 3, 4),
                     async_save=True, keep_last=2)
    assert asyn[0]["losses"] == sync[0]["losses"]
    assert sorted(p.name for p in (tmp_path / "async").iterdir()) == ["latest", "step-00000003", "step-00000004"]
    from zeroshard.toolkit.consolidate import consolidate

    for name in ("sync", "async"):
        consolidate(str(tmp_path / name), str(tmp_path / f"{name}.safetensors"))
    assert (tmp_path / "sync.safetensors").read_bytes() == (tmp_path / "async.safetensors").read_bytes()


def strict_load(rank: int, world: int, ckpt: str) -> tuple[list[str], list[str]]:
    import warnings

    errors, said = [], []
    for kwargs in ({"layers": 3}, {"tied": False}, {"compiled": True}):
        model = make_model(**{k: v for k, v in kwargs.items() if k != "compiled"})
        if kwargs.get("compiled"):
            model = torch.compile(model)  # parameters named _orig_mod.*; nothing compiles without a forward
        engine = zeroshard.initialize(model=model, optimizer=build_optimizer("adamw", model),
                                      config={"zero_optimization": {"stage": 3}})
        try:
            engine.load_checkpoint(ckpt)
        except zeroshard.ZeroshardError as exc:
            errors.append(str(exc))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine.load_checkpoint(ckpt, strict=False)  # the deliberate partial load works, and says so
            except zeroshard.ZeroshardError as exc:  # unless it would load nothing at all
                errors.append(str(exc))
        said.append(" | ".join(str(w.message) for w in caught if "strict=False" in str(w.message)))
    return errors, said


@pytest.mark.slow
def test_strict_load_lists_the_names(world4):
    (errors, said), (_, said_1) = run_ranks(strict_load, 2, timeout=120, ckpt=world4["ckpt"])
    assert "blocks.2." in errors[0] and "missing from the checkpoint" in errors[0]
    assert "head.weight" in errors[1] and "strict=False loads the others" in errors[1]
    assert "keep their values (blocks.2." in said[0] and said_1 == ["", "", ""]  # rank 0 says it
    assert "keep their values (head.weight)" in said[1]
    # a model wrapped by torch.compile: every name differs by its prefix, so nothing would load
    for error in errors[2:]:
        assert "starts with '_orig_mod.'" in error and "torch.compile" in error, error
    assert len(errors) == 4 and said[2] == ""


def pretrained(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model = make_model(seed=5)
    engine = zeroshard.initialize(model=model, optimizer=build_optimizer("adamw", model),
                                  config={"zero_optimization": {"stage": 3}})
    engine.load_pretrained(path)
    return engine.full_state_dict()


@pytest.mark.slow
def test_load_pretrained_full_model_and_hf_folder(world4, tmp_path):
    from safetensors.torch import load_file

    from zeroshard.toolkit.consolidate import consolidate

    consolidate(world4["ckpt"], str(tmp_path / "m.safetensors"))
    consolidate(world4["ckpt"], str(tmp_path / "hf"), max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    want = load_file(str(tmp_path / "m.safetensors"))
    for source in ("m.safetensors", "hf"):
        got = run_ranks(pretrained, 2, timeout=120, path=str(tmp_path / source))[0]
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (source, name)


@pytest.mark.s3
def test_save_and_load_on_s3(s3_bucket, s3_endpoint):
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_DEFAULT_REGION")}
    ckpt = f"{s3_bucket}/run"
    first = run_ranks(run, 2, timeout=180, env=env, stage=3, steps=2, ckpt=ckpt, save_at=(1,))
    resumed = run_ranks(run, 2, timeout=180, env=env, stage=1, steps=2, resume=ckpt)
    assert_losses_close(resumed[0]["losses"], first[0]["losses"][1:], 1e-5)
    assert_state_close(resumed[0]["state"], first[0]["state"], 1e-5)
