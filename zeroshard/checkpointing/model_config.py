"""The model's own config, recorded in the manifest so `zeroshard consolidate` can write the
config.json beside the weights without being told (manifest extra["model_config"]).

A Hugging Face model carries a PretrainedConfig (`to_json_string` gives what `save_pretrained`
writes); a dataclass config is recorded as its fields. Anything else, or a config that is not
JSON, is simply not recorded: the checkpoint is complete without it and `--config` still works.
A PEFT model's adapter configs are recorded beside (extra["peft_config"]) for `consolidate --peft`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


def model_config_of(module: Any) -> dict[str, Any] | None:
    """The JSON dict of `module.config` (HF PretrainedConfig or a dataclass), else None."""
    config = getattr(module, "config", None)
    try:
        if hasattr(config, "to_json_string"):  # what save_pretrained writes as config.json
            value = json.loads(config.to_json_string(use_diff=False))
        elif dataclasses.is_dataclass(config) and not isinstance(config, type):
            value = json.loads(json.dumps(dataclasses.asdict(config)))
        else:
            return None
    except (TypeError, ValueError):  # not JSON: leave it out rather than fail the save
        return None
    return value if isinstance(value, dict) else None


def peft_config_of(module: Any) -> dict[str, dict[str, Any]] | None:
    """A PEFT model's adapter configs, {adapter name: adapter_config.json as PeftModel.save_pretrained
    writes it}, else None (manifest extra["peft_config"]; `consolidate --peft` writes it). Duck-typed:
    the engine never imports peft. Anything unexpected leaves it out rather than fail the save."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    try:
        return {str(name): _adapter_config(module, config) for name, config in configs.items()}
    except Exception:  # a peft release that differs: the checkpoint is complete without it
        return None


def _adapter_config(module: Any, config: Any) -> dict[str, Any]:
    """What save_pretrained puts in adapter_config.json: to_dict(), sets as lists (sorted here:
    PEFT writes a set in hash order, which changes from process to process), inference_mode true,
    the base model's name_or_path, and auto_mapping (the base model's class) when no task_type."""
    value = {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in config.to_dict().items()}
    value["inference_mode"] = True
    prompt = bool(getattr(config, "is_prompt_learning", False))
    if value.get("base_model_name_or_path") is None:
        base = module.base_model if prompt else module.base_model.model
        value["base_model_name_or_path"] = base.__dict__.get("name_or_path", None) or None
    if value.get("task_type") is None:
        cls = module._get_base_model_class(is_prompt_tuning=prompt)
        value["auto_mapping"] = {"base_model_class": cls.__name__, "parent_library": cls.__module__}
    return json.loads(json.dumps(value))  # JSON or nothing (PeftType is a str enum: its value)
