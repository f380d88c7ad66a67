"""The model's own config, recorded in the manifest so `zeroshard consolidate` can write the
config.json beside the weights without being told (manifest extra["model_config"]).

A Hugging Face model carries a PretrainedConfig (`to_json_string` gives what `save_pretrained`
writes); a dataclass config is recorded as its fields. Anything else, or a config that is not
JSON, is simply not recorded: the checkpoint is complete without it and `--config` still works.
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
