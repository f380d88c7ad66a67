"""ZeroConfig: DeepSpeed-style dicts/JSON in, validated dataclasses out (no process group needed)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from zeroshard import ZeroConfig
from zeroshard.engine.config import ConfigError, FP16Config, ZeroOptimizationConfig

TIER = "default"  # docs/TESTING.md

DEEPSPEED_STYLE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "overlap_comm": True,
                          "stage3_unit_classes": ["Block"]},
}


def test_dict_json_and_dataclass_forms_agree(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEEPSPEED_STYLE))
    from_dict = ZeroConfig.coerce(DEEPSPEED_STYLE)
    from_path = ZeroConfig.coerce(str(path))
    built = ZeroConfig(zero_optimization=ZeroOptimizationConfig(stage=3, reduce_bucket_size=500_000_000,
                                                                stage3_unit_classes=["Block"]),
                       gradient_accumulation_steps=2, gradient_clipping=1.0,
                       train_micro_batch_size_per_gpu=4)
    built.bf16.enabled = True
    assert from_dict == from_path == ZeroConfig.coerce(built)
    assert from_dict.digest() == built.digest()
    assert from_dict.stage == 3 and from_dict.compute_dtype == torch.bfloat16
    assert from_dict.reduce_dtype == torch.float32
    assert from_dict.zero_optimization.reduce_bucket_size == 500_000_000  # 5e8 accepted as an int


def test_defaults() -> None:
    cfg = ZeroConfig.coerce(None)
    assert cfg.stage == 0 and cfg.compute_dtype == torch.float32 and cfg.resolve_accumulation(4) == 1


@pytest.mark.parametrize("bad, words", [
    ({"zero_optimisation": {"stage": 2}}, "unknown config key 'zero_optimisation' (did you mean 'zero_optimization'?)"),
    ({"zero_optimization": {"stag": 2}}, "unknown config key 'zero_optimization.stag'"),
    ({"fp16": {"enabled": True, "scale_window": 10}}, "'fp16.scale_window'"),
    ({"zero_optimization": {"stage": 4}}, "stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": "2"}}, "'zero_optimization.stage' has the wrong type"),
    ({"zero_optimization": {"stage": True}}, "'zero_optimization.stage' has the wrong type"),
    ({"gradient_accumulation_steps": "auto"}, "'gradient_accumulation_steps' is 'auto'"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "mutually exclusive"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "offload_optimizer needs stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "only 'cpu'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     "'zero_optimization.offload_optimizer.pin_memroy'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param needs stage 3"),
    ({"optimizer": {"type": "Adam"}}, "build the optimizer yourself"),
    ({"scheduler": {"type": "WarmupLR"}}, "lr_scheduler"),
    ({"communication_data_type": "int8"}, "communication_data_type"),
    ({"gradient_clipping": -1}, "gradient_clipping"),
    ({"zero_optimization": []}, "must be an object"),
])
def test_bad_configs_name_the_key(bad: dict, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        ZeroConfig.coerce(bad)
    assert words in str(info.value)


def test_ignored_deepspeed_keys_warn_once() -> None:
    cfg = {"steps_per_print": 10, "wall_clock_breakdown": False,
           "zero_optimization": {"stage": 2, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9},
           "fp16": {"enabled": False, "auto_cast": False},
           "zero_allow_untested_optimizer": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = ZeroConfig.coerce(cfg)
    assert parsed.stage == 2
    assert len(caught) == 1
    text = str(caught[0].message)
    for key in ("steps_per_print", "zero_optimization.contiguous_gradients", "fp16.auto_cast",
                "zero_optimization.stage3_max_live_parameters", "zero_allow_untested_optimizer"):
        assert key in text


def test_offload_to_none_is_fine() -> None:
    assert ZeroConfig.coerce({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}).stage == 2


def test_offload_optimizer_to_cpu_is_accepted() -> None:
    cfg = ZeroConfig.coerce({"zero_optimization": {"stage": 2,
                                                   "offload_optimizer": {"device": "cpu", "pin_memory": True}}})
    assert cfg.zero_optimization.offload_optimizer == {"device": "cpu", "pin_memory": True}


def test_batch_sizes_resolve_accumulation() -> None:
    cfg = ZeroConfig.coerce({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})
    assert cfg.resolve_accumulation(4) == 2
    with pytest.raises(ConfigError, match="not divisible"):
        cfg.resolve_accumulation(3)
    inconsistent = ZeroConfig.coerce({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                      "gradient_accumulation_steps": 4})
    with pytest.raises(ConfigError, match="train_batch_size=32 !="):
        inconsistent.resolve_accumulation(4)


def test_digest_differs_when_settings_differ() -> None:
    a = ZeroConfig.coerce({"zero_optimization": {"stage": 1}})
    b = ZeroConfig.coerce({"zero_optimization": {"stage": 2}})
    assert a.digest() != b.digest() and a.digest() == ZeroConfig.coerce({"zero_optimization": {"stage": 1}}).digest()


def test_fp16_settings_and_communication_dtype() -> None:
    cfg = ZeroConfig.coerce({"fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 1},
                             "communication_data_type": "bf16"})
    assert cfg.compute_dtype == torch.float16 and cfg.reduce_dtype == torch.bfloat16
    assert cfg.fp16 == FP16Config(enabled=True, initial_scale_power=12, hysteresis=1)
