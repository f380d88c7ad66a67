"""The Checkpointer: Stateful objects beside the engine (global and per rank), rank-state blobs,
one agreement for failures, and checkpoints written before rank-state blobs."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import zeroshard
from zeroshard.checkpointing.stateful import decode_rank_state, encode_rank_state, name_stateful, to_json_value

from distributed import run_ranks

TIER = "mixed"  # docs/TESTING.md

LEGACY = Path(__file__).parent / "data" / "engine-1.1-rng"


class Position:
    """A data position: per rank (scope "rank") or shared (the default)."""

    def __init__(self, value: int, scope: str = "global", fail_on_save: bool = False) -> None:
        self.value, self.checkpoint_scope, self.fail_on_save = value, scope, fail_on_save

    def state_dict(self) -> dict[str, Any]:
        if self.fail_on_save:
            raise RuntimeError("this position cannot be saved")
        if self.checkpoint_scope == "global":  # saved as JSON: no tensors
            return {"value": self.value}
        return {"value": self.value, "history": torch.arange(self.value + 1, dtype=torch.int32)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])
        if self.checkpoint_scope == "rank":
            assert torch.equal(state["history"], torch.arange(self.value + 1, dtype=torch.int32))


def _engine(seed: int = 0, stage: int = 2) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    return zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                config={"zero_optimization": {"stage": stage}})


def _step(engine: Any, seed: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def save_positions(rank: int, world: int, path: str, fail_rank: int | None = None) -> dict[str, Any]:
    engine = _engine()
    _step(engine, rank)
    shared = Position(7, fail_on_save=False)
    mine = Position(10 + rank, scope="rank", fail_on_save=rank == fail_rank)
    ckpt = zeroshard.Checkpointer(engine, shared=shared, mine=mine)
    try:
        ckpt.save(path, tag="t", async_save=True)
        ckpt.wait()
        return {"saved": True}
    except zeroshard.CheckpointSaveError as exc:
        return {"saved": False, "error": str(exc)}


def load_positions(rank: int, world: int, path: str) -> dict[str, Any]:
    import warnings

    engine = _engine(seed=5)
    shared, mine = Position(0), Position(-1, scope="rank")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zeroshard.Checkpointer(engine, shared=shared, mine=mine).load(path)
    return {"shared": shared.value, "mine": mine.value, "warnings": [str(w.message) for w in caught]}


@pytest.mark.slow
def test_stateful_objects_come_back_global_everywhere_and_per_rank_only_at_the_same_world(tmp_path):
    run_ranks(save_positions, 2, timeout=120, path=str(tmp_path / "ck"))
    same = run_ranks(load_positions, 2, timeout=120, path=str(tmp_path / "ck" / "t"))
    assert [r["shared"] for r in same] == [7, 7]
    assert [same[r]["mine"] for r in range(2)] == [10, 11]
    other = run_ranks(load_positions, 3, timeout=120, path=str(tmp_path / "ck" / "t"))
    assert [other[r]["shared"] for r in range(3)] == [7, 7, 7]
    assert [other[r]["mine"] for r in range(3)] == [-1, -1, -1]  # per-rank state means nothing at world 3
    assert any("per-rank state of 'mine' not restored" in w for w in other[0]["warnings"])  # and rank 0 says so
    assert not any("not restored" in w for r in (1, 2) for w in other[r]["warnings"])
    assert not any("not restored" in w for r in range(2) for w in same[r]["warnings"])

    manifest = json.loads((tmp_path / "ck" / "t" / "zeroshard.json").read_text())
    assert manifest["extra"]["stateful"]["shared"]["value"] == 7
    assert "rng" not in manifest["extra"] and "mine" not in json.dumps(manifest["extra"])
    # A rank-state blob is plain safetensors, readable without zeroshard's loader.
    from safetensors.torch import load, load_file

    blob = load_file(str(tmp_path / "ck" / "t" / "rank-00001-of-00002.safetensors"))["rank-state/rank-00001"]
    inner = load(blob.numpy().tobytes())
    assert torch.equal(inner["mine/history"], torch.arange(12, dtype=torch.int32))
    assert json.loads(bytes(inner["__json__"].numpy()).decode())["mine"]["value"] == 11


def load_leaving_state_out(rank: int, world: int, path: str, legacy: str) -> dict[str, list[str]]:
    """Loads that restore less than the checkpoint holds, and the warnings each gave."""
    import warnings

    import zeroshard.deepspeed

    def caught(load) -> list[str]:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            load()
        return [str(w.message) for w in got if "is not restored" in str(w.message)]

    engine = _engine(seed=5)
    mine = Position(-1, scope="rank")
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))  # the legacy one
    ds, *_ = zeroshard.deepspeed.initialize(model=mlp, optimizer=torch.optim.AdamW,
                                            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                            config={"train_micro_batch_size_per_gpu": 1})
    return {"shared_not_given": caught(lambda: zeroshard.Checkpointer(engine, mine=mine).load(path)),
            "weights_only_load": caught(lambda: engine.load_checkpoint(path, load_optimizer_states=False)),
            "legacy_scheduler_not_given": caught(lambda: _engine(seed=3).load_checkpoint(legacy)),
            "deepspeed_skips_it_on_purpose": caught(lambda: ds.load_checkpoint(legacy, load_lr_scheduler_states=False)),
            "deepspeed_given": caught(lambda: ds.load_checkpoint(legacy))}


def test_saved_state_nothing_is_given_for_is_named_on_a_resume(tmp_path):
    """A resume that restores the engine but not a saved LR schedule would train on with the
    schedule at its first step: rank 0 warns, naming the key; a weights-only load and a DeepSpeed
    load_lr_scheduler_states=False (skipped on purpose) do not."""
    run_ranks(save_positions, 2, timeout=120, path=str(tmp_path / "ck"))
    shutil.copytree(LEGACY, tmp_path / "legacy")
    got = run_ranks(load_leaving_state_out, 2, timeout=120, path=str(tmp_path / "ck" / "t"),
                    legacy=str(tmp_path / "legacy"))
    assert "saved state of 'shared' is not restored" in got[0]["shared_not_given"][0]
    assert "saved state of 'lr_scheduler' is not restored" in got[0]["legacy_scheduler_not_given"][0]
    assert got[0]["weights_only_load"] == got[0]["deepspeed_skips_it_on_purpose"] == got[0]["deepspeed_given"] == []
    assert all(w == [] for w in got[1].values())  # rank 0 alone says it


def test_a_stateful_failing_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    result = run_ranks(save_positions, 2, timeout=120, path=str(tmp_path / "ck"), fail_rank=1)
    for rank in range(2):
        assert not result[rank]["saved"]
        assert "rank(s) 1" in result[rank]["error"] or "cannot be saved" in result[rank]["error"]
    assert "cannot be saved" in result[0]["error"]  # the others are told why
    assert not (tmp_path / "ck" / "t" / "zeroshard.json").exists()
    assert not (tmp_path / "ck" / "latest").exists()


def save_with_a_full_disk_on(rank: int, world: int, path: str, full: int) -> dict[str, Any]:
    """A committed save, then one during which rank `full`'s write fails (its disk is full)."""
    from zeroshard.checkpointing import save as save_module

    engine = _engine()
    _step(engine, rank)
    engine.save_checkpoint(path, tag="good")
    real = save_module.write_rank_file

    def write(*args: Any, **kwargs: Any) -> Any:
        if rank == full:
            raise OSError(28, "No space left on device (injected)")
        return real(*args, **kwargs)

    save_module.write_rank_file = write
    try:
        engine.save_checkpoint(path, tag="next")
    except zeroshard.CheckpointSaveError as exc:
        return {"error": str(exc)}
    finally:
        save_module.write_rank_file = real  # the worker process runs other tests after this one
    return {"error": None}


@pytest.mark.parametrize("full", [0, 1])
def test_a_failed_save_leaves_no_rank_files_and_no_folder_behind(tmp_path, full):
    """Before, the ranks that did write kept their files (a failed save on a full disk left its
    rank files there, filling the disk for the next save) and the tag's folder stayed."""
    from zeroshard.toolkit.verify import verify

    result = run_ranks(save_with_a_full_disk_on, 2, timeout=120, path=str(tmp_path / "ck"), full=full)
    assert all(r["error"] and "No space left" in r["error"] and "nothing committed" in r["error"] for r in result)
    assert not (tmp_path / "ck" / "next").exists()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["good", "latest"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "good"
    assert verify(str(tmp_path / "ck")).ok


def load_legacy(rank: int, world: int, path: str) -> dict[str, Any]:
    engine = _engine(seed=3)
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    client = engine.load_checkpoint(path, lr_scheduler=sched)
    return {"client": client, "torch": torch.rand(3).tolist(), "python": [random.random() for _ in range(3)],
            "numpy": np.random.rand(3).tolist(), "scheduler": sched.state_dict(), "lr": sched.get_last_lr(),
            "full": {k: v.tolist() for k, v in engine.full_state_dict().items()}, "steps": engine.global_steps}


def test_checkpoints_from_before_rank_state_blobs_restore_rng_and_scheduler(tmp_path):
    shutil.copytree(LEGACY, tmp_path / "ck")
    result = run_ranks(load_legacy, 2, timeout=120, path=str(tmp_path / "ck"))
    for rank in range(2):
        want = json.loads((LEGACY / f"expected-rank{rank}.json").read_text())
        got = result[rank]
        assert got["client"] == {"next_step": 2} and got["steps"] == 2
        assert got["torch"] == want["torch"] and got["python"] == want["python"] and got["numpy"] == want["numpy"]
        assert got["scheduler"] == want["scheduler"] and got["lr"] == want["lr"]
    assert result[0]["full"] == json.loads((LEGACY / "expected-rank0.json").read_text())["full"]


def save_for_size(rank: int, world: int, path: str) -> None:
    engine = _engine()
    _step(engine, rank)
    engine.save_checkpoint(path, tag="t")


@pytest.mark.slow
def test_the_manifest_holds_nothing_per_rank_but_a_file_and_a_rank_state_entry(tmp_path):
    sizes = {}
    for world in (2, 4):
        run_ranks(save_for_size, world, timeout=120, path=str(tmp_path / f"w{world}"))
        sizes[world] = (tmp_path / f"w{world}" / "t" / "zeroshard.json").stat().st_size
    per_rank = (sizes[4] - sizes[2]) / 2
    assert per_rank < 600, sizes  # the JSON RNG states of earlier versions cost ~14 KB per rank


def test_stateful_objects_are_named_by_keyword_key_or_kind():
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), 1)
    rng = zeroshard.RNGState()
    named = name_stateful((sched, rng), {"data": Position(1)})
    assert list(named) == ["lr_scheduler", "rng", "data"]
    with pytest.raises(TypeError, match="pass it by keyword"):
        name_stateful((Position(1),), {})
    with pytest.raises(ValueError, match="'rng'"):
        name_stateful((rng, zeroshard.RNGState()), {})
    with pytest.raises(TypeError, match="state_dict"):
        name_stateful((), {"x": object()})
    with pytest.raises(ValueError, match="checkpoint_scope"):
        name_stateful((), {"x": Position(1, scope="node")})


def test_rank_state_blobs_round_trip_and_reject_garbage():
    state = {"rng": zeroshard.RNGState().state_dict(), "pos": {"n": 3, "nested": [1.5, None, torch.ones(2)]}}
    back = decode_rank_state(encode_rank_state(state), "x")
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["pos"]["n"] == 3 and back["pos"]["nested"][:2] == [1.5, None]
    assert torch.equal(back["pos"]["nested"][2], torch.ones(2))
    with pytest.raises(ValueError, match="where: malformed rank-state blob"):
        decode_rank_state(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage", "where")
    with pytest.raises(TypeError, match="cannot be stored as JSON"):
        encode_rank_state({"bad": {"obj": object()}})
    with pytest.raises(TypeError, match="checkpoint_scope = \"rank\""):
        to_json_value({"t": torch.ones(2)}, "state of 'x'")


def load_rejecting(rank: int, world: int, path: str) -> str:
    engine = _engine(seed=5)

    class Picky(Position):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            if dist.get_rank() == 1:
                raise ValueError("rank 1 wants another position")
            super().load_state_dict(state)

    try:
        zeroshard.Checkpointer(engine, shared=Picky(0)).load(path)
    except zeroshard.ZeroshardError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_a_stateful_rejecting_its_state_on_one_rank_raises_on_every_rank(tmp_path):
    run_ranks(save_positions, 2, timeout=120, path=str(tmp_path / "ck"))
    result = run_ranks(load_rejecting, 2, timeout=120, path=str(tmp_path / "ck" / "t"))
    assert result[1].startswith("CheckpointError") and "rank 1 wants another position" in result[1]
    assert result[0].startswith("OtherRanksFailedError") and "rank(s) 1" in result[0]


def train_during_async_save(rank: int, world: int, path: str, slow_writer: bool) -> dict[str, Any]:
    """Save asynchronously, then train two more steps while the save may still be writing."""
    import time

    from zeroshard.checkpointing import snapshot

    if slow_writer:  # every tensor takes a while to write: the steps surely overlap the save
        fill = snapshot.BackgroundSave.fill

        def slow(self, *args: Any) -> None:
            time.sleep(0.02)
            fill(self, *args)

        snapshot.BackgroundSave.fill = slow
    engine = _engine(stage=1)
    _step(engine, rank)
    at_save = engine.full_state_dict()
    opt_at_save = {n: {k: v.clone() for k, v in i.tensor_state.items()} for n, i in engine.named_shards()}
    engine.save_checkpoint(path, tag="t", async_save=True)
    if not slow_writer:
        engine.checkpointer._thread.join()  # the write is over before the next step
    _step(engine, rank + 10)
    _step(engine, rank + 20)
    engine.wait()
    copied = sum(b.numel() for b in engine.checkpointer._lazy.buffers)
    fresh = _engine(seed=9, stage=1)
    fresh.load_checkpoint(path + "/t")
    opt_loaded = {n: {k: v.clone() for k, v in i.tensor_state.items()} for n, i in fresh.named_shards()}
    same_opt = all(torch.equal(opt_at_save[n][k], opt_loaded[n][k]) for n in opt_at_save for k in opt_at_save[n])
    return {"at_save": at_save, "loaded": fresh.full_state_dict(), "copied": copied, "same_opt": same_opt,
            "moved_on": engine.global_steps}


@pytest.mark.parametrize("slow_writer", [True, False], ids=["steps-overlap-the-write", "write-done-first"])
def test_async_saves_are_copy_on_write(tmp_path, slow_writer):
    result = run_ranks(train_during_async_save, 2, timeout=120, path=str(tmp_path / "ck"), slow_writer=slow_writer)
    assert result[0]["moved_on"] == 3
    for name, value in result[0]["at_save"].items():
        assert torch.equal(value, result[0]["loaded"][name]), name  # what was saved is the state at save()
    assert all(r["same_opt"] for r in result)
    if slow_writer:
        assert all(r["copied"] > 0 for r in result)  # the step copied what was not written yet
    else:
        assert all(r["copied"] == 0 for r in result)  # nothing to protect: no copy at all


def writes_behind_per_save_kind(rank: int, world: int, path: str) -> dict[str, Any]:
    """Which saves hand their writes to a thread (write_behind), and what a sync save so written loads."""
    from zeroshard.checkpointing import save as save_module

    asked: list[bool] = []
    real = save_module.write_rank_file

    def spy(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("write_behind", False))
        return real(*args, **kwargs)

    save_module.write_rank_file = spy
    try:
        engine = _engine(stage=1)
        _step(engine, rank)
        at_save = engine.full_state_dict()
        engine.save_checkpoint(path, tag="sync")
        engine.save_checkpoint(path, tag="async", async_save=True)  # state in host memory: read in place
        engine.wait()
    finally:
        save_module.write_rank_file = real  # the worker process runs other tests after this one
    fresh = _engine(seed=9, stage=1)
    fresh.load_checkpoint(path + "/sync")
    loaded = fresh.full_state_dict()
    return {"asked": asked, "same": all(torch.equal(v, loaded[k]) for k, v in at_save.items())}


def test_sync_saves_write_behind_and_async_saves_reading_in_place_do_not(tmp_path):
    """A write handed to a thread is still in flight when fill returns; an async save that reads
    live tensors marks a tensor written (safe from copy-on-write) at that moment, so it must write
    inline, or the next step could change bytes still being written (hashed before, torn after)."""
    result = run_ranks(writes_behind_per_save_kind, 2, timeout=120, path=str(tmp_path / "ck"))
    assert all(r["asked"] == [True, False] for r in result)
    assert all(r["same"] for r in result)


def load_anywhere(rank: int, world: int, path: str, behind: bool | None = None) -> str:
    from zeroshard.checkpointing.load import spare_core

    assert behind is None or spare_core(world) == behind  # the reader hashes on a thread, or not
    engine = _engine(seed=5)
    try:
        engine.load_checkpoint(path)
    except zeroshard.ZeroshardError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


# LOCAL_WORLD_SIZE: ranks on this node, against its cores (checkpointing.load.spare_core)
BEHIND = {True: {"LOCAL_WORLD_SIZE": "1"}, False: {"LOCAL_WORLD_SIZE": "100000"}}


@pytest.mark.parametrize("behind", [False, True], ids=["hashed-inline", "hashed-behind"])
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_flipped_byte_is_caught_by_a_load_at_any_world_size(tmp_path, world, behind):
    """At another world size a rank reads only parts of the saved fragments; their hashes cover
    whole fragments, so the loader reads the rest too (into scratch) to check them. With a core
    to spare the hashing runs on a thread behind the reads: the mismatch is still every rank's
    error, before the engine is restored."""
    from test_bad_input import flip_byte_in

    run_ranks(save_for_size, 2, timeout=120, path=str(tmp_path / "ck"))
    flip_byte_in(tmp_path / "ck" / "t" / "rank-00000-of-00002.safetensors", "0.weight")
    result = run_ranks(load_anywhere, world, timeout=120, path=str(tmp_path / "ck" / "t"), behind=behind,
                       env=BEHIND[behind])
    assert all(r != "loaded" for r in result), result
    assert any("0.weight" in r and "hash mismatch" in r for r in result), result


@pytest.mark.parametrize("field, value", [
    (("extra", "engine", "global_steps"), {"not": "a number"}),
    (("extra", "rng", "0", "python"), 5),
    (("optimizer", "param_groups"), "not a list"),
])
def test_hostile_training_fields_fail_the_load_on_every_rank(tmp_path, field, value):
    """Whatever a manifest's training fields hold, every rank raises a ZeroshardError: none is
    left waiting in a collective while another died of a TypeError."""
    shutil.copytree(LEGACY, tmp_path / "ck")
    manifest = tmp_path / "ck" / "step-2" / "zeroshard.json"
    doc = json.loads(manifest.read_text())
    node = doc
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    manifest.write_text(json.dumps(doc))
    result = run_ranks(load_anywhere, 2, timeout=120, path=str(tmp_path / "ck"))
    assert all(r.split(":")[0] in ("CheckpointError", "OtherRanksFailedError") for r in result), result
    assert all("partly overwritten" not in r for r in result), result  # refused before a byte was read
    assert any(r.startswith("CheckpointError") and "step-2/zeroshard.json" in r and "malformed" in r
               for r in result), result


@pytest.mark.slow
@pytest.mark.exclusive
def test_steps_wait_on_a_background_write_only_for_what_it_reads_in_place():
    """Every optimizer step calls detach() while an async save is in flight. It used to take the
    writer's lock each time, so each step waited for the tensor being written, I/O included,
    even after the first call and even when nothing was read in place (state on a GPU is copied
    at once): on an H100, 12 steps beside a save took 1.83x as long as without one."""
    import threading
    import time

    from zeroshard.checkpointing.contents import Held, RankContents
    from zeroshard.checkpointing.snapshot import BackgroundSave, Snapshot
    from zeroshard.format.writer import TensorSpec

    specs = [TensorSpec("buf", "buffer", "F32", (4,)), TensorSpec("m", "param", "F32", (4,))]

    def background(stepped: set[str]) -> BackgroundSave:
        held = {"buf": Held(torch.ones(4), 0), "m": Held(torch.zeros(4), 0)}
        return BackgroundSave(RankContents(specs, held, stepped, {}), Snapshot(), Snapshot())

    def writing(save: BackgroundSave, spec: TensorSpec, hold_s: float) -> threading.Thread:
        """A writer inside fill() for `spec`, its write taking `hold_s` seconds."""
        inside = threading.Event()

        def slow_write(view: memoryview) -> None:
            inside.set()
            time.sleep(hold_s)

        thread = threading.Thread(target=save.fill, args=(spec, 0, 4, slow_write))
        thread.start()
        assert inside.wait(30)
        return thread

    def detach_seconds(save: BackgroundSave) -> float:
        t0 = time.monotonic()
        save.detach()
        return time.monotonic() - t0

    # "m" is read in place; while "buf" (a copy) is being written, the first step copies "m" at once
    save = background({"m"})
    writer = writing(save, specs[0], 3.0)
    assert detach_seconds(save) < 1.5
    assert torch.equal(save.contents.held["m"].tensor, torch.zeros(4))  # the copy the writer will read
    writer.join()
    # a later step never waits, whatever is being written
    writer = writing(save, specs[1], 3.0)
    assert detach_seconds(save) < 1.5
    writer.join()
    # nothing read in place (as on a GPU): the first step does not wait either
    save = background(set())
    writer = writing(save, specs[1], 3.0)
    assert detach_seconds(save) < 1.5
    writer.join()


def test_a_loaded_scalar_state_goes_where_the_optimizer_keeps_it():
    """Adam's `step`: where the live state has it, else where torch.optim puts it (the parameter's
    device only for a capturable or fused group). On a GPU, a `step` on the device costs a plain
    Adam one sync per parameter per step; tests/test_engine_gpu.py checks it there, this checks
    the rule on a device every machine has (meta)."""
    from zeroshard.checkpointing.load import _scalar_device

    master = torch.empty(4, device="meta")
    assert _scalar_device(None, master, {"lr": 0.1}) == "cpu"
    assert _scalar_device(None, master, {"capturable": True}) == master.device
    assert _scalar_device(None, master, {"fused": True}) == master.device
    assert _scalar_device(torch.tensor(1.0, device="meta"), torch.empty(4), {}) == torch.device("meta")


@pytest.mark.parametrize("outcome, removes", [
    ("others failed", True),  # the exchange completed: every rank saw the failure, none commits
    ("own failure", True),
    ("peer lost", False),  # the exchange failed here: rank 0 may have committed, keep the file
    ("exchange broke", False),
])
def test_a_save_removes_its_file_only_when_the_ranks_agreed_it_failed(monkeypatch, outcome, removes):
    from zeroshard.checkpointing import save as save_module
    from zeroshard.errors import CheckpointSaveError, OtherRanksFailedError, PeerLostError

    own = CheckpointSaveError("rank 1: disk full") if outcome == "own failure" else None
    raised = {"others failed": OtherRanksFailedError("the checkpoint save", {0: "disk full"}),
              "own failure": own,
              "peer lost": PeerLostError("the checkpoint save", {0: "nodeA"}, "connection closed"),
              "exchange broke": RuntimeError("gloo: connection reset by peer")}[outcome]

    def agree(*args, **kwargs):
        raise raised

    monkeypatch.setattr(save_module, "agree", agree)
    abandoned = []
    with pytest.raises((CheckpointSaveError, PeerLostError)):
        save_module.agree_on_save(own, None, None, lambda: abandoned.append(True))
    assert abandoned == ([True] if removes else [])
