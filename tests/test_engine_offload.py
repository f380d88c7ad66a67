"""offload_optimizer: masters and optimizer state on the host, same numerics as without it.

On this CPU-only CI the device is the CPU too, so this checks the offload code path end to end
(config, host masters, gradients accumulated into them, norm, step, gathers), not the copies;
tests/test_engine_gpu.py checks where the tensors live on CUDA.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard

from distributed import run_ranks
from test_engine_models import batches, make_model, train_step

TIER = "default"  # docs/TESTING.md


def train(rank: int, world: int, stage: int, offload: bool) -> dict[str, Any]:
    model = make_model()
    z: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 3000}
    if offload:
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                  {"zero_optimization": z, "gradient_clipping": 0.5,
                                   "gradient_accumulation_steps": 2})
    losses = [train_step(engine, b, rank, world, 2) for b in batches(3, 8 * world)]
    masters = {s.master.device.type for _, s in engine.named_shards()}
    return {"losses": losses, "full": engine.full_state_dict(), "norm": engine.last_grad_norm,
            "master_devices": masters, "master_device": str(engine.master_device)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_matches_plain_training(stage: int) -> None:
    plain = run_ranks(train, 2, stage=stage, offload=False)[0]
    off = run_ranks(train, 2, stage=stage, offload=True)
    assert off[0]["master_device"] == "cpu" and off[0]["master_devices"] == {"cpu"}
    for a, b in zip(off[0]["losses"], plain["losses"]):
        assert a == pytest.approx(b, rel=1e-6)
    assert off[0]["norm"] == pytest.approx(plain["norm"], rel=1e-6)
    for k, v in plain["full"].items():
        torch.testing.assert_close(off[0]["full"][k], v, rtol=1e-6, atol=1e-7)
    assert off[1]["losses"] == off[0]["losses"]
