"""Bad use gives a clear error on every rank, never a hang (each launch has a hard timeout).

Ranks catch the expected exceptions themselves and return them, so the worker pool survives.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.engine.optim import check_elementwise, check_user_optimizer
from zeroshard.format.manifest import HASH_TABLE_NAME
from zeroshard.format.training_state import rank_state_key
from zeroshard.storage.hashing import hash_bytes, xxh3_int
from zeroshard.toolkit.verify import verify

from distributed import run_ranks
from test_engine_models import batches, lm_loss, make_model, micro_batch

TIER = "mixed"  # docs/TESTING.md


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _catch(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return type(e).__name__, str(e)
    return "no error", ""


class Leaky(nn.Module):
    """Uses a child's parameter in its own forward: invalid at stage 3 with per-module units."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.inner.weight.t()


def bad_use(rank: int, world: int) -> dict[str, tuple[str, str]]:
    out = {}
    x, y = micro_batch(batches(1, 4)[0], rank, world, 0, 1)

    def step_without_backward() -> None:
        model = make_model()
        engine = zeroshard.initialize(model=model, optimizer=_adam(model), config={"zero_optimization": {"stage": 2}})
        engine(x)
        engine.step()
    out["step_without_backward"] = _catch(step_without_backward)

    def second_step() -> None:
        model = make_model()
        engine = zeroshard.initialize(model=model, optimizer=_adam(model), config={"zero_optimization": {"stage": 1}})
        engine.backward(lm_loss(engine(x), y))
        engine.step()
        engine.step()
    out["second_step"] = _catch(second_step)

    def no_parameters() -> None:
        zeroshard.initialize(model=nn.ReLU(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    out["no_parameters"] = _catch(no_parameters)

    def float64_parameter() -> None:
        model = nn.Linear(4, 4).double()
        zeroshard.initialize(model=model, optimizer=_adam(model))
    out["float64_parameter"] = _catch(float64_parameter)

    def config_mismatch() -> None:
        model = make_model()
        zeroshard.initialize(model=model, optimizer=_adam(model),
                             config={"zero_optimization": {"stage": 1 + rank}})
    out["config_mismatch"] = _catch(config_mismatch)

    def model_mismatch() -> None:
        model = make_model(layers=1 + rank)
        zeroshard.initialize(model=model, optimizer=_adam(model))
    out["model_mismatch"] = _catch(model_mismatch)

    def bad_config_on_one_rank() -> None:
        model = make_model()
        cfg = {"zero_optimization": {"stage": 1}} if rank == 0 else {"zero_optimisation": {"stage": 1}}
        zeroshard.initialize(model=model, optimizer=_adam(model), config=cfg)
    out["bad_config_on_one_rank"] = _catch(bad_config_on_one_rank)

    def plain_loss_backward() -> None:
        model = make_model()
        engine = zeroshard.initialize(model=model, optimizer=_adam(model), config={"zero_optimization": {"stage": 2}})
        lm_loss(engine(x), y).backward()
    out["plain_loss_backward"] = _catch(plain_loss_backward)

    def lbfgs() -> None:
        model = make_model()
        zeroshard.initialize(model=model, optimizer=torch.optim.LBFGS(model.parameters()))
    out["lbfgs"] = _catch(lbfgs)

    def outside_unit() -> None:
        model = Leaky()
        engine = zeroshard.initialize(model=model, optimizer=_adam(model), config={"zero_optimization": {"stage": 3}})
        engine(torch.ones(2, 4))
    out["outside_unit"] = _catch(outside_unit)

    def outside_unit_fixed() -> None:  # the remedy the message suggests
        model = Leaky()
        engine = zeroshard.initialize(model=model, optimizer=_adam(model),
                                      config={"zero_optimization": {"stage": 3, "stage3_unit_classes": ["Leaky"]}})
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    out["outside_unit_fixed"] = _catch(outside_unit_fixed)

    def unknown_unit_class() -> None:
        model = make_model()
        zeroshard.initialize(model=model, optimizer=_adam(model),
                             config={"zero_optimization": {"stage": 3, "stage3_unit_classes": ["Blok"]}})
    out["unknown_unit_class"] = _catch(unknown_unit_class)
    return out


@pytest.fixture(scope="module")
def errors() -> list[dict[str, tuple[str, str]]]:
    return run_ranks(bad_use, 2, timeout=120)


@pytest.mark.parametrize("case, kind, words", [
    ("step_without_backward", "EngineUsageError", "without engine.backward"),
    ("second_step", "EngineUsageError", "without engine.backward"),
    ("no_parameters", "InvalidArgumentError", "has no parameters"),
    ("float64_parameter", "InvalidArgumentError", "float64 parameters (weight, bias): the engine keeps fp32 master"),
    ("config_mismatch", "ConfigError", "differs between rank 0 and rank(s) [1]: zero_optimization.stage is 2 on "
                                       "rank 1, 1 on rank 0"),
    ("model_mismatch", "RanksBuiltDifferentModelsError",
     "ranks built different models: rank 1 has 31 parameters, rank 0 19 (parameter 'blocks.1.gain' is on rank 1 only)"),
    ("plain_loss_backward", "EngineUsageError", "call engine.backward(loss)"),
    ("lbfgs", "ArgumentTypeError", "LBFGS updates whole tensors"),
    ("outside_unit", "EngineUsageError", "stage3_unit_classes"),
    ("outside_unit_fixed", "no error", ""),
    ("unknown_unit_class", "ConfigError", "no module of class ['Blok']"),
])
def test_bad_use_raises_on_every_rank(errors: list[dict], case: str, kind: str, words: str) -> None:
    for rank_errors in errors:
        got_kind, message = rank_errors[case]
        assert got_kind == kind and words in message, (case, got_kind, message)


def test_a_bad_config_on_one_rank_fails_everywhere(errors: list[dict]) -> None:
    kind, message = errors[0]["bad_config_on_one_rank"]  # rank 0 is told which rank failed, and why
    assert kind == "OtherRanksFailedError" and "zeroshard.initialize failed on rank(s) 1" in message
    assert "'zero_optimisation'" in message
    kind, message = errors[1]["bad_config_on_one_rank"]
    assert kind == "ConfigError" and "'zero_optimisation'" in message and "zero_optimization" in message


class Plain(nn.Module):
    """Standard modules only (reset_parameters initializes them) and a real buffer."""

    def __init__(self, out: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, out))
        self.register_buffer("scale", torch.ones(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def build_mismatches(rank: int, world: int) -> dict[str, tuple[str, str, bool]]:
    """Each case builds the model differently on some ranks; initialize must refuse it alike on
    every rank before any collective that depends on the model (gloo crashed or hung before)."""
    out = {}

    def init(model: nn.Module, stage: int = 3, **kwargs: Any) -> None:
        zeroshard.initialize(model=model, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3),
                             config={"zero_optimization": {"stage": stage}}, **kwargs)

    def zero_init_on_one_rank(stage: int) -> None:
        with zeroshard.zero_init(enabled=rank == 1):
            model = Plain()
        init(model, stage)

    def meta_device_on_one_rank() -> None:
        with torch.device("meta" if rank == 2 else "cpu"):
            model = Plain()
        init(model, init_fn=lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)

    def partly_meta() -> None:
        model = Plain()
        if rank == 1:
            model.body[0].weight = nn.Parameter(torch.empty(8, 4, device="meta"))
        init(model)

    def other_shape() -> None:
        init(Plain(out=5 if rank == 2 else 4))

    def other_dtype() -> None:
        init(Plain().to(torch.bfloat16 if rank == 1 else torch.float32))

    def frozen_on_one_rank() -> None:
        model = Plain()
        model.body[2].bias.requires_grad_(rank != 0)
        init(model)

    def other_order() -> None:
        model = Plain()
        if rank == 1:  # same parameters, registered in another order
            model.body = nn.Sequential()
            model.body.add_module("2", nn.Linear(8, 4))
            model.body.add_module("0", nn.Linear(4, 8))
        init(model)

    def same_after_all() -> None:  # the set-up is still sound after all those refusals
        with zeroshard.zero_init():
            model = Plain()
        init(model)

    cases = {"zero_init_stage3": lambda: zero_init_on_one_rank(3), "zero_init_stage1": lambda: zero_init_on_one_rank(1),
             "meta_device": meta_device_on_one_rank, "partly_meta": partly_meta, "shape": other_shape,
             "dtype": other_dtype, "frozen": frozen_on_one_rank, "order": other_order, "same": same_after_all}
    for name, case in cases.items():
        try:
            case()
            out[name] = ("no error", "", False)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            named = isinstance(e, zeroshard.ZeroshardError)
            out[name] = (type(e).__name__, str(e), named)
    return out


@pytest.fixture(scope="module")
def mismatches() -> list[dict[str, tuple[str, str, bool]]]:
    return run_ranks(build_mismatches, 3, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("case, words", [
    ("zero_init_stage3", "rank 1 built the model under zero_init(), ranks 0, 2 eagerly"),
    ("zero_init_stage1", "rank 1 built the model under zero_init(), ranks 0, 2 eagerly"),
    ("meta_device", "rank 2 built the model on the meta device (1 buffer on the meta device too), ranks 0, 1 eagerly"),
    ("partly_meta", "rank 1 built the model with 1 of its 4 parameters on the meta device, ranks 0, 2 eagerly"),
    ("shape", "parameter 'body.2.weight' has shape [5, 8] on rank 2, [4, 8] on ranks 0, 1"),
    ("dtype", "parameter 'body.0.weight' has dtype 'torch.bfloat16' on rank 1, 'torch.float32' on ranks 0, 2"),
    ("frozen", "parameter 'body.2.bias' has requires_grad True on ranks 1, 2, False on rank 0"),
    ("order", "parameters are registered in another order on rank 1 than on ranks 0, 2"),
])
def test_ranks_building_different_models_all_get_the_same_named_error(mismatches: list[dict], case: str,
                                                                      words: str) -> None:
    messages = {mismatches[rank][case][1] for rank in range(3)}
    assert len(messages) == 1, messages  # the same message on every rank
    for rank in range(3):
        kind, message, is_zeroshard_error = mismatches[rank][case]
        assert kind == "RanksBuiltDifferentModelsError" and is_zeroshard_error, (case, kind, message)
        assert message.startswith("zeroshard.initialize: ranks built different models: ") and words in message, \
            (case, message)


@pytest.mark.slow
def test_ranks_that_built_the_same_model_go_on(mismatches: list[dict]) -> None:
    assert [m["same"][0] for m in mismatches] == ["no error"] * 3


class MyLoader:
    """A data loader's position, saved for every rank alike (scope "global", in the manifest)."""

    def __init__(self, position: int = 0, reject_on: int | None = None) -> None:
        self.position, self.reject_on = position, reject_on

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.reject_on == torch.distributed.get_rank():
            raise ValueError(f"position {state['position']} is past the end\n(a second line no one needs)")
        self.position = state["position"]


class Shuffle(MyLoader):
    """A per-rank shuffle order (scope "rank": saved in each rank's file, with a tensor)."""

    checkpoint_scope = "rank"

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "order": torch.arange(5) + self.position}


def _small_engine(optimizer: Callable[[nn.Module], torch.optim.Optimizer] = _adam) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    return zeroshard.initialize(model=model, optimizer=optimizer(model), config={"zero_optimization": {"stage": 2}})


def save_loaders(rank: int, world: int, path: str) -> None:
    zeroshard.Checkpointer(_small_engine(), dataloader=MyLoader(3), shuffle=Shuffle(10 + rank)).save(path, tag="t")


def load_loaders(rank: int, world: int, path: str, reject: str | None) -> dict[str, Any]:
    """Load with one Stateful rejecting its state on rank 1; then prove the ranks are still in step."""
    loader = MyLoader(reject_on=1 if reject == "dataloader" else None)
    shuffle = Shuffle(reject_on=1 if reject == "shuffle" else None)
    kind, message = _catch(lambda: zeroshard.Checkpointer(_small_engine(), dataloader=loader, shuffle=shuffle)
                           .load(path))
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # nobody was left behind in a collective
    return {"kind": kind, "message": message, "in_step": t.item() == world, "shuffle": shuffle.position}


@pytest.fixture(scope="module")
def saved_loaders(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("loaders") / "ck"
    run_ranks(save_loaders, 2, timeout=120, path=str(path))
    return str(path / "t")


@pytest.mark.parametrize("reject, cls, source", [("dataloader", "MyLoader", "zeroshard.json"),
                                                 ("shuffle", "Shuffle", "rank-00001-of-00002.safetensors")])
def test_a_stateful_rejecting_its_state_names_object_class_rank_and_file(saved_loaders: str, reject: str, cls: str,
                                                                         source: str) -> None:
    failed, other = run_ranks(load_loaders, 2, timeout=120, path=saved_loaders, reject=reject)[::-1]
    words = (f"{source}: rank 1: restoring {reject!r} ({cls}.load_state_dict) failed: ValueError: position "
             f"{3 if reject == 'dataloader' else 11} is past the end ...")
    assert failed["kind"] == "CheckpointError" and failed["message"].endswith(words), failed
    assert "\n" not in failed["message"] and "second line" not in failed["message"]
    assert other["kind"] == "OtherRanksFailedError", other
    assert other["message"].startswith("the checkpoint load failed on rank(s) 1: rank 1: "), other
    assert words in other["message"], other
    assert failed["in_step"] and other["in_step"]


def forge_tensor(ckpt: Path, rank: int, name: str, data: bytes) -> None:
    """Replace tensor `name`'s bytes in rank `rank`'s file and record fresh hashes for it (the
    fragment table and the manifest's whole-file hash): only its content can tell it is wrong."""
    manifest = json.loads((ckpt / "zeroshard.json").read_text())
    entry = next(f for f in manifest["files"] if f["rank"] == rank)
    raw = bytearray((ckpt / entry["name"]).read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    base = 8 + length
    begin, end = header[name]["data_offsets"]
    assert len(data) == end - begin
    raw[base + begin:base + end] = data
    in_order = sorted((h["data_offsets"][0], n) for n, h in header.items()
                      if n not in ("__metadata__", HASH_TABLE_NAME))
    slot = [n for _, n in in_order].index(name)
    table = base + header[HASH_TABLE_NAME]["data_offsets"][0] + 8 * slot
    raw[table:table + 8] = struct.pack("<Q", xxh3_int(data))
    (ckpt / entry["name"]).write_bytes(bytes(raw))
    entry["hash"] = hash_bytes(bytes(raw))
    (ckpt / "zeroshard.json").write_text(json.dumps(manifest))


def test_a_garbage_rank_state_blob_with_fresh_hashes_names_file_tensor_and_rank(saved_loaders: str,
                                                                                tmp_path: Path) -> None:
    ckpt = tmp_path / "t"
    shutil.copytree(saved_loaders, ckpt)
    name = rank_state_key(1)
    raw = (ckpt / "rank-00001-of-00002.safetensors").read_bytes()
    begin, end = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])[name]["data_offsets"]
    forge_tensor(ckpt, 1, name, bytes(range(256)) * ((end - begin) // 256) + b"\xff" * ((end - begin) % 256))
    assert verify(str(ckpt), deep=True).ok  # every hash holds: the load must find it by its content
    failed, other = run_ranks(load_loaders, 2, timeout=120, path=str(ckpt), reject=None)[::-1]
    words = f"rank-00001-of-00002.safetensors: rank 1: tensor {name!r} (this rank's Stateful states): malformed " \
            "rank-state blob ("
    assert failed["kind"] == "CheckpointError" and words in failed["message"], failed
    assert other["kind"] == "OtherRanksFailedError" and "failed on rank(s) 1: rank 1: " in other["message"]
    assert words in other["message"], other
    assert failed["in_step"] and other["in_step"]


# -- a checkpoint resumed with another optimizer --------------------------------------------------------

OPTIMIZERS = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9),
              "adamw": lambda m: torch.optim.AdamW(m.parameters()),
              "amsgrad": lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True)}


def _one_step(engine: Any) -> None:
    engine.backward(engine(torch.ones(2, 4)).square().mean())
    engine.step()


def save_with(rank: int, world: int, path: str, kind: str) -> None:
    engine = _small_engine(OPTIMIZERS[kind])
    _one_step(engine)
    engine.save_checkpoint(path, tag=kind)


def resume_with(rank: int, world: int, path: str, kind: str, load_optimizer_states: bool) -> dict[str, Any]:
    import warnings

    engine = _small_engine(OPTIMIZERS[kind])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _catch(lambda: engine.load_checkpoint(path, load_optimizer_states=load_optimizer_states))
    stepped = _catch(lambda: _one_step(engine)) if error[0] == "no error" else None
    return {"error": error, "stepped": stepped, "warnings": [str(w.message) for w in caught]}


@pytest.fixture(scope="module")
def saved_optimizers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("optimizers")
    for kind in ("sgd", "adamw", "amsgrad"):
        run_ranks(save_with, 2, timeout=120, path=str(root), kind=kind)
    return root


@pytest.mark.parametrize("saved, resumed, missing", [("sgd", "adamw", "exp_avg, exp_avg_sq"),
                                                     ("adamw", "sgd", "momentum_buffer"),
                                                     ("adamw", "amsgrad", "max_exp_avg_sq")])
def test_optimizer_state_another_optimizer_needs_is_refused_at_the_load(saved_optimizers: Path, saved: str,
                                                                        resumed: str, missing: str) -> None:
    """It loaded without a word and the first step failed inside torch (KeyError: 'exp_avg')."""
    for result in run_ranks(resume_with, 2, timeout=120, path=str(saved_optimizers / saved), kind=resumed,
                            load_optimizer_states=True):
        kind, message = result["error"]
        assert kind == "CheckpointError" and f"has no {missing}, which this torch.optim." in message, message
        assert str(saved_optimizers / saved) in message and "load_optimizer_states=False" in message
    fresh = run_ranks(resume_with, 2, timeout=120, path=str(saved_optimizers / saved), kind=resumed,
                      load_optimizer_states=False)
    assert all(r["error"] == ("no error", "") and r["stepped"] == ("no error", "") for r in fresh), fresh


def test_optimizer_state_an_optimizer_does_not_use_is_named(saved_optimizers: Path) -> None:
    rank0, rank1 = run_ranks(resume_with, 2, timeout=120, path=str(saved_optimizers / "amsgrad"), kind="adamw",
                             load_optimizer_states=True)
    assert rank0["error"] == rank0["stepped"] == rank1["stepped"] == ("no error", "")
    assert any("does not use max_exp_avg_sq: it stays as loaded" in w for w in rank0["warnings"]), rank0
    assert not any("max_exp_avg_sq" in w for w in rank1["warnings"])  # said once, by rank 0
    same = run_ranks(resume_with, 2, timeout=120, path=str(saved_optimizers / "adamw"), kind="adamw",
                     load_optimizer_states=True)
    assert all(r["stepped"] == ("no error", "") and not r["warnings"] for r in same), same


# -- checks that need no process group ---------------------------------------------------------------


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam, torch.optim.Adafactor])
def test_whole_tensor_optimizers_are_refused(cls: type) -> None:
    with pytest.raises(TypeError, match="elementwise"):
        check_elementwise(cls)


def test_muon_like_names_are_refused() -> None:
    Muon = type("Muon", (torch.optim.SGD,), {})
    with pytest.raises(TypeError, match="Muon"):
        check_elementwise(Muon)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
                                 torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam])
def test_elementwise_optimizers_are_accepted(cls: type) -> None:
    check_elementwise(cls)


def test_optimizer_with_state_is_refused() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="already has state"):
        check_user_optimizer(opt, model)


def test_optimizer_on_foreign_or_missing_params_is_refused() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        check_user_optimizer(torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1), model)
    with pytest.raises(ValueError, match="'bias' requires grad but is in no optimizer param group"):
        check_user_optimizer(torch.optim.SGD([model.weight], lr=0.1), model)
