"""Meta-device init: a model built without storage is materialized by initialize, with exactly
the weights eager init gives under the same seed, at any world size and stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

from distributed import run_ranks
from test_engine_models import VOCAB, Block, TinyGPT, batches, train_step

TIER = "mixed"  # docs/TESTING.md


class Plain(nn.Module):
    """Only standard modules (reset_parameters replays their init), a tied head, a real buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.body = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.tok(idx)) * self.scale)


def tiny_init(m: nn.Module) -> None:
    """Custom __init__ values (Block.gain, TinyGPT.temp, Plain.scale); the rest: reset_parameters."""
    if isinstance(m, Plain):
        m.scale.copy_(torch.linspace(0.5, 1.5, 32))
    elif isinstance(m, Block):
        m.gain.fill_(1.0)
    elif isinstance(m, TinyGPT):
        m.temp.copy_(torch.tensor([1.0, 0.5, 0.25]))
    else:
        m.reset_parameters()


def build(kind: str, how: str) -> nn.Module:
    torch.manual_seed(0)
    cls = Plain if kind == "plain" else TinyGPT
    if how == "eager":
        return cls()
    if how == "meta":
        with torch.device("meta"):
            return cls()
    with zeroshard.zero_init():
        return cls()


def init_and_train(rank: int, world: int, kind: str, how: str, stage: int) -> dict[str, Any]:
    model = build(kind, how)
    built_on_meta = any(p.is_meta for p in model.parameters())
    engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                                  {"zero_optimization": {"stage": stage}},
                                  init_fn=tiny_init if how == "meta" else None)
    after_init = engine.full_state_dict()
    rng = torch.get_rng_state()
    losses = [train_step(engine, b, rank, world, 1) for b in batches(2, 4 * world)]
    return {"meta": built_on_meta, "init": after_init, "rng": rng, "losses": losses,
            "trained": engine.full_state_dict()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("kind,how", [("tiny", "meta"), ("plain", "meta"), ("plain", "zero_init")])
@pytest.mark.parametrize("stage,world", [(0, 2), (2, 2), (3, 2), (3, 3)])
def test_meta_init_equals_eager_init(kind: str, how: str, stage: int, world: int) -> None:
    eager = run_ranks(init_and_train, world, kind=kind, how="eager", stage=stage)[0]
    meta = run_ranks(init_and_train, world, kind=kind, how=how, stage=stage)
    assert meta[0]["meta"] and not eager["meta"]
    _same(meta[0]["init"], eager["init"])  # bit-identical weights and buffers
    assert torch.equal(meta[0]["rng"], eager["rng"])  # the RNG consumed exactly as eager init does
    assert meta[0]["losses"] == eager["losses"]
    _same(meta[0]["trained"], eager["trained"])
    for r in meta[1:]:
        assert r["losses"] == meta[0]["losses"]


def missing_init(rank: int, world: int) -> str:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT()  # Block.gain and TinyGPT.temp have no reset_parameters
    try:
        zeroshard.initialize(model, torch.optim.Adam(model.parameters()), {"zero_optimization": {"stage": 3}})
    except ValueError as e:
        return str(e)
    return "no error"


def test_meta_tensor_without_initializer_is_refused_on_every_rank() -> None:
    for msg in run_ranks(missing_init, 2):
        assert "the root module (TinyGPT) holds meta tensors ['temp']" in msg and "init_fn" in msg


def pretrained_into_meta(rank: int, world: int, path: str) -> dict[str, Any]:
    with zeroshard.zero_init():
        model = Plain()
    engine = zeroshard.initialize(model, torch.optim.Adam(model.parameters()), {"zero_optimization": {"stage": 3}})
    engine.load_pretrained(path)
    return {"full": engine.full_state_dict(),
            "master_elems": sum(s.master.numel() for s in engine.shards),
            "stored": sum(p.untyped_storage().size() for p in model.parameters())}


def test_load_pretrained_into_meta_built_stage3_engine(tmp_path: Any) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(5)
    ref = Plain()
    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "head.weight"}  # tied: saved once
    save_file(sd, str(tmp_path / "model.safetensors"))
    out = run_ranks(pretrained_into_meta, 2, path=str(tmp_path / "model.safetensors"))
    full = out[0]["full"]
    for k, v in ref.state_dict().items():
        assert torch.equal(full[k], v), k
    numel = sum(p.numel() for p in ref.parameters())
    for r in out:
        assert r["stored"] == 0  # no full parameter outside a unit's forward/backward
        assert r["master_elems"] <= numel // 2 + 64


def test_zero_init_puts_only_parameters_on_meta_and_can_be_disabled() -> None:
    with zeroshard.zero_init():
        on_meta = Plain()
    with zeroshard.zero_init(enabled=False):
        real = Plain()
    assert all(p.is_meta for p in on_meta.parameters()) and on_meta.head.weight is on_meta.tok.weight
    assert not on_meta.scale.is_meta and torch.equal(on_meta.scale, real.scale)
    assert not any(p.is_meta for p in real.parameters())
    assert not any(p.is_meta for p in Plain().parameters())  # the patch is gone after the block
