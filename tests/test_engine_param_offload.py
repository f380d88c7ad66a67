"""offload_param at stage 3: partitions in host memory (cpu) or in files (nvme), same numerics.

On this CPU-only machine the compute device is the host too, so the tests make the tier's
role visible another way: the gathers must read the tier's copy (corrupting it changes the
model's output, `update()` repairs it), the NVMe file must hold the bytes, and read-ahead must
be used. tests/test_engine_gpu.py-style checks of pinned memory need CUDA (skipped here).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import zeroshard
from zeroshard.engine.config import ConfigError, ZeroConfig
from zeroshard.engine.layout import build_shards
from zeroshard.engine.param_offload import ALIGN, NvmeTier

from checkpoints import read_checkpoint
from distributed import run_ranks
from test_engine_models import batches, make_model, micro_batch, train_step

TIER = "mixed"  # docs/TESTING.md

STEPS = 3


def _config(offload: str | None, opt_offload: bool, nvme: str | None, bf16: bool = False) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": 3, "reduce_bucket_size": 3000, "stage3_unit_classes": ["Block"]}
    if offload:
        z["offload_param"] = {"device": offload, "pin_memory": True, "buffer_count": 3, "buffer_size": 40_000}
        if offload == "nvme":
            z["offload_param"]["nvme_path"] = nvme
    if opt_offload:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": z, "gradient_clipping": 0.5, "gradient_accumulation_steps": 2,
            "bf16": {"enabled": bf16}}


def _probe_tier(engine: Any, x: torch.Tensor) -> bool:
    """Corrupt the tier's copy of the partitions: the output must change (gathers read the tier),
    and come back after update() (the masters are intact)."""
    tier = engine.param_tier
    with torch.no_grad():
        before = engine(x)
        if tier.kind == "cpu":
            tier.buffer.zero_()
        else:
            _zero_file(tier)
        corrupted = engine(x)
        tier.update()
        after = engine(x)
    return (not torch.equal(before, corrupted)) and torch.equal(before, after)


def _zero_file(tier: NvmeTier) -> None:
    from zeroshard.engine.param_offload import _aligned, _io, _memory
    tier.flush()
    tier._drain_reads()  # read-ahead data from before would hide the corruption
    zeros = _aligned(tier.size, False).zero_()
    _io(os.pwritev, tier.fd, _memory(zeros), 0, tier.path)


def train(rank: int, world: int, offload: str | None, opt_offload: bool, nvme: str | None = None,
          bf16: bool = False, ckpt: str | None = None, resume: str | None = None) -> dict[str, Any]:
    # Every RNG a checkpoint's rank state holds starts alike in each run (make_model seeds torch's):
    # a rank process runs other tests' code between calls, which may draw from Python's or NumPy's
    random.seed(rank)
    np.random.seed(rank)
    model = make_model(layers=3)
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                  _config(offload, opt_offload, nvme, bf16))
    if resume:
        engine.load_checkpoint(resume)
    losses = [train_step(engine, b, rank, world, 2) for b in batches(STEPS, 8 * world)]
    out: dict[str, Any] = {"losses": losses, "full": engine.full_state_dict(), "norm": engine.last_grad_norm,
                           "report": engine.memory_report(), "kind": engine.param_tier.kind,
                           "stats": dict(getattr(engine.param_tier, "stats", {})),
                           "owned": sum(s.chunk for s in engine.shards)}
    if offload == "nvme":
        out["file"] = os.path.exists(engine.param_tier.path)
        out["direct"] = engine.param_tier.direct
    if ckpt:
        engine.save_checkpoint(ckpt)
    if offload:
        x = micro_batch(batches(1, 8 * world, seed=9)[0], rank, world, 0, 1)[0]
        out["tier_is_source"] = _probe_tier(engine, x)
        engine.param_tier.close()
        if offload == "nvme":
            out["file_after_close"] = os.path.exists(engine.param_tier.path)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("offload, world, opt_offload", [
    ("cpu", 2, False), ("cpu", 3, True), ("nvme", 2, True), ("nvme", 3, False)])
def test_param_offload_trains_like_no_offload(offload: str, world: int, opt_offload: bool, tmp_path: Path) -> None:
    plain = run_ranks(train, world, timeout=240, offload=None, opt_offload=opt_offload)[0]
    off = run_ranks(train, world, timeout=240, offload=offload, opt_offload=opt_offload, nvme=str(tmp_path))
    assert plain["kind"] == "none" and off[0]["kind"] == offload
    for a, b in zip(off[0]["losses"], plain["losses"]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    assert off[0]["norm"] == pytest.approx(plain["norm"], rel=1e-6)
    for k, v in plain["full"].items():
        torch.testing.assert_close(off[0]["full"][k], v, rtol=1e-6, atol=1e-7)
    for r in off:
        assert r["losses"] == off[0]["losses"]
        assert r["tier_is_source"]
        if offload == "cpu":
            assert r["report"]["param_offload_host"] == r["owned"] * 4
            assert r["stats"]["bytes_up"] > 0 and r["stats"]["updates"] == STEPS + 1
        else:
            assert r["file"] and not r["file_after_close"]
            assert r["report"]["param_offload_nvme"] >= r["owned"] * 4
            st = r["stats"]
            assert st["bytes_read"] > 0 and st["bytes_written"] >= r["owned"] * 4 * (STEPS + 1)
            assert st["read_ahead_hits"] > 0  # units read from the file before their gather asked
    assert {p.name for p in tmp_path.iterdir()} == set()  # nvme files removed at close


def changing_order(rank: int, world: int, nvme: str | None, buffer_count: int) -> list[float]:
    """Steps that skip `mix` (a unit) leave the recorded order: read-ahead data goes stale."""
    model = make_model(layers=3)
    z: dict[str, Any] = {"stage": 3, "reduce_bucket_size": 3000}
    if nvme:
        z["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": buffer_count}
    engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), {"zero_optimization": z})
    losses = []
    for i, b in enumerate(batches(5, 4 * world)):
        model.use_mix = i % 2 == 0
        losses.append(train_step(engine, b, rank, world, 1))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("buffer_count", [1, 2])
def test_nvme_read_ahead_survives_a_changing_unit_order(buffer_count: int, tmp_path: Path) -> None:
    plain = run_ranks(changing_order, 2, timeout=240, nvme=None, buffer_count=0)[0]
    nvme = run_ranks(changing_order, 2, timeout=240, nvme=str(tmp_path), buffer_count=buffer_count)[0]
    for a, b in zip(nvme, plain):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)


def test_bf16_param_offload_matches_and_holds_bf16(tmp_path: Path) -> None:
    plain = run_ranks(train, 2, timeout=240, offload=None, opt_offload=False, bf16=True)[0]
    cpu = run_ranks(train, 2, timeout=240, offload="cpu", opt_offload=True, bf16=True)[0]
    nvme = run_ranks(train, 2, timeout=240, offload="nvme", opt_offload=False, nvme=str(tmp_path), bf16=True)[0]
    assert cpu["losses"] == plain["losses"] == nvme["losses"]  # the same cast, from the same masters
    assert cpu["report"]["param_offload_host"] == cpu["owned"] * 2  # the partition is in the compute dtype


@pytest.mark.slow
def test_checkpoints_of_offloaded_runs_load_at_another_world_size(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    saved = run_ranks(train, 2, timeout=240, offload="nvme", opt_offload=True, nvme=str(nvme), ckpt=ckpt)[0]
    reference = run_ranks(train, 2, timeout=240, offload=None, opt_offload=False, ckpt=ckpt + "-plain")[0]
    assert saved["full"].keys() == reference["full"].keys()
    # the same training first (so a difference below is the checkpoint's, not the steps')
    for a, b in zip(saved["losses"], reference["losses"]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7), (saved["losses"], reference["losses"])
    for k, v in reference["full"].items():
        torch.testing.assert_close(saved["full"][k], v, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    # The same format: the same tensors (weights and optimizer state) under the same names.
    got, want = read_checkpoint(ckpt), read_checkpoint(ckpt + "-plain")
    assert got.keys() == want.keys() and any("exp_avg" in k for k in got)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    # Resumed at world 3: offloaded to the host, to NVMe, or not at all; all continue alike.
    plain = run_ranks(train, 3, timeout=240, offload=None, opt_offload=False, resume=ckpt)[0]
    cpu = run_ranks(train, 3, timeout=240, offload="cpu", opt_offload=False, resume=ckpt)[0]
    disk = run_ranks(train, 3, timeout=240, offload="nvme", opt_offload=True, nvme=str(nvme), resume=ckpt)[0]
    for other in (cpu, disk):
        for a, b in zip(other["losses"], plain["losses"]):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    # And the resumed runs really started from the saved weights: their first loss is the
    # saved model's, not a fresh model's.
    fresh = run_ranks(train, 3, timeout=240, offload=None, opt_offload=False)[0]
    assert plain["losses"][0] != pytest.approx(fresh["losses"][0], rel=1e-4)


@pytest.mark.parametrize("spec, words", [
    ({"device": "disk"}, "offload_param.device='disk'"),
    ({"device": "nvme"}, "needs nvme_path"),
    ({"device": "cpu", "buffer_count": 0}, "offload_param.buffer_count must be an integer >= 1"),
    ({"device": "cpu", "pin_memory": "yes"}, "offload_param.pin_memory"),
    ({"device": "cpu", "prefetch": 2}, "unknown config key 'zero_optimization.offload_param.prefetch'"),
])
def test_bad_offload_param_configs_name_the_key(spec: dict, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        ZeroConfig.coerce({"zero_optimization": {"stage": 3, "offload_param": spec}})
    assert words in str(info.value) and "\n" not in str(info.value)


def refused(rank: int, world: int, spec: dict[str, Any]) -> str:
    model = make_model()
    try:
        zeroshard.initialize(model, torch.optim.Adam(model.parameters()),
                             {"zero_optimization": {"stage": 3, "offload_param": spec}})
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_missing_nvme_path_and_small_buffers_are_refused_on_every_rank(tmp_path: Path) -> None:
    missing = run_ranks(refused, 2, spec={"device": "nvme", "nvme_path": str(tmp_path / "nope")})
    assert all("nvme_path" in m and "is not a directory" in m for m in missing)
    small = run_ranks(refused, 2, spec={"device": "nvme", "nvme_path": str(tmp_path), "buffer_size": 100})
    assert all("buffer_size=100 elements is smaller than stage-3 unit" in m for m in small)


# -- the NVMe tier on its own (no process group) --------------------------------------------


class _Unit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(33, 17)
        self.b = torch.nn.Linear(17, 5)


def _tier(tmp_path: Path, **spec: Any) -> tuple[NvmeTier, list]:
    torch.manual_seed(0)
    shards = build_shards(_Unit(), 1, 0, torch.device("cpu"))
    units = [shards[:2], shards[2:]]
    return NvmeTier(units, torch.float32, torch.device("cpu"), {"nvme_path": str(tmp_path), **spec}, 0), shards


def _read_back(tier: NvmeTier, shards: list) -> list[torch.Tensor]:
    out = []
    for u, unit in enumerate(tier.units):
        targets = [torch.full((s.chunk,), float("nan")) for s in unit]
        tier.fill(u, unit, targets)
        out += targets
    return out


def test_nvme_tier_round_trips_with_aligned_regions(tmp_path: Path) -> None:
    tier, shards = _tier(tmp_path, buffer_count=2)
    tier.update()
    # buffer_count staging buffers, one kept for a read on demand: one unit read ahead at most.
    tier.flush()
    assert len(tier.free) == 2 and tier.depth == 1
    tier.read_ahead([0, 1])
    assert list(tier.reads) == [0]
    assert tier.report()["param_offload_staging"] == 2 * max(plan[2] for plan in tier.plans)
    assert all(off % ALIGN == 0 for off in tier.offset.values())
    assert tier.size == sum(-(-s.chunk * 4 // ALIGN) * ALIGN for s in shards)
    for got, s in zip(_read_back(tier, shards), shards):
        assert torch.equal(got, s.master)
    for s in shards:  # the masters change: update() writes them, reads see the new values
        s.master.mul_(-2)
    tier.update()
    tier.read_ahead([0, 1])
    for got, s in zip(_read_back(tier, shards), shards):
        assert torch.equal(got, s.master)
    tier.close()
    assert not os.path.exists(tier.path)


def test_nvme_tier_falls_back_to_buffered_io_without_o_direct(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def no_direct(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument", path)  # as tmpfs and some network filesystems answer
        return real_open(path, flags, mode)
    monkeypatch.setattr(os, "open", no_direct)
    tier, shards = _tier(tmp_path)
    assert not tier.direct
    tier.update()
    for got, s in zip(_read_back(tier, shards), shards):
        assert torch.equal(got, s.master)
    tier.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_nvme_tier_uses_o_direct_where_the_filesystem_allows(tmp_path: Path) -> None:
    tier, _ = _tier(tmp_path)
    fs_allows = True
    try:
        fd = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        os.close(fd)
    except OSError:
        fs_allows = False
    assert tier.direct == fs_allows
    tier.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host partitions")
def test_host_tier_is_pinned_on_cuda() -> None:
    from zeroshard.engine.param_offload import HostTier
    shards = build_shards(_Unit().cuda(), 1, 0, torch.device("cuda"))
    tier = HostTier(shards, torch.bfloat16, torch.device("cuda"), pin=True)
    tier.update()
    assert tier.buffer.is_pinned() and tier.buffer.dtype == torch.bfloat16
    target = torch.empty(shards[0].chunk, dtype=torch.bfloat16, device="cuda")
    tier.fill(0, shards[:1], [target])
    torch.testing.assert_close(target.float(), shards[0].master, rtol=1e-2, atol=1e-2)


# -- the DeepSpeed facade's offload keys ------------------------------------------------------


def test_deepspeed_offload_keys_map_to_the_engine(tmp_path: Path) -> None:
    from zeroshard.deepspeed.config import split_config

    ds = {"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                                      "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "pipeline_read": False, "fast_init": False,
                              "ratio": 1.0, "cpuadam_cores_perc": 0.8}}}
    zero = ZeroConfig.coerce(split_config(ds, 2).engine).zero_optimization
    assert zero.offload_param["device"] == "nvme" and zero.offload_param["buffer_size"] == 1e8
    assert zero.offload_optimizer == {"device": "cpu", "pin_memory": True}
    # DeepSpeed's deprecated booleans become the sections they stand for (not ignored).
    old = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                        "cpu_offload_use_pin_memory": False}}
    zero = ZeroConfig.coerce(split_config(old, 2).engine).zero_optimization
    assert zero.offload_param == {"device": "cpu", "pin_memory": False} == zero.offload_optimizer


@pytest.mark.parametrize("zero, words", [
    ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "zero_optimization.offload_optimizer.ratio=0.5"),
    ({"offload_optimizer": {"device": "cpu", "super_offload": True}}, "offload_optimizer.super_offload=True"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}, "offload_optimizer.device='nvme'"),
    ({"offload_param": {"device": "cpu", "prefetch_depth": 2}}, "'zero_optimization.offload_param.prefetch_depth'"),
    ({"cpu_offload_param": True, "offload_param": {"device": "cpu"}}, "zero_optimization.cpu_offload_param and"),
    ({"cpu_offload": "yes"}, "zero_optimization.cpu_offload must be true or false"),
])
def test_deepspeed_offload_keys_refused_name_the_key(zero: dict, words: str) -> None:
    from zeroshard.deepspeed.config import split_config
    from zeroshard.errors import ZeroshardError

    with pytest.raises(ZeroshardError) as info:
        ZeroConfig.coerce(split_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, **zero}}, 2).engine)
    assert words in str(info.value) and "\n" not in str(info.value)


def deepspeed_run(rank: int, world: int, zero: dict[str, Any]) -> dict[str, Any]:
    import zeroshard.deepspeed as deepspeed

    model = make_model(layers=3)
    cfg = {"train_batch_size": 8 * world, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 3, **zero}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    losses = [train_step(engine, b, rank, world, 2) for b in batches(STEPS, 8 * world)]
    return {"losses": losses, "kind": engine.engine.param_tier.kind, "getters": (
        engine.zero_offload_param(), engine.zero_offload_optimizer(), engine.zero_cpu_offload(),
        engine.zero_hpz_partition_size())}


def test_deepspeed_initialize_offloads_params_to_nvme(tmp_path: Path) -> None:
    plain = run_ranks(deepspeed_run, 2, timeout=240, zero={})[0]
    nvme = run_ranks(deepspeed_run, 2, timeout=240, zero={
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}, "cpu_offload": True})[0]
    assert plain["kind"] == "none" and nvme["kind"] == "nvme"
    assert plain["getters"] == (None, None, False, 1)  # DeepSpeed's getters answer what the config turned on
    assert nvme["getters"][0]["device"] == "nvme" and nvme["getters"][1]["device"] == "cpu" and nvme["getters"][2]
    for a, b in zip(nvme["losses"], plain["losses"]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
