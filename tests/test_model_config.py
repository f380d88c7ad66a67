"""The model config an engine save records (manifest extra["model_config"]), which consolidate
writes as config.json. The end-to-end case with a real HF model is in test_hf_models.py."""

from __future__ import annotations

import dataclasses

import torch

from zeroshard.checkpointing.model_config import model_config_of

TIER = "default"  # docs/TESTING.md


@dataclasses.dataclass
class TinyConfig:
    n_layer: int = 2
    n_embd: int = 8
    names: tuple = ("a", "b")


class WithConfig(torch.nn.Linear):
    def __init__(self, config):
        super().__init__(2, 2)
        self.config = config


class JsonConfig:
    """Duck-typed like transformers.PretrainedConfig."""

    def to_json_string(self, use_diff: bool = True) -> str:
        assert use_diff is False  # the whole config, not only what differs from the defaults
        return '{"model_type": "llama", "hidden_size": 32}'


def test_a_dataclass_config_is_recorded_as_its_fields():
    assert model_config_of(WithConfig(TinyConfig())) == {"n_layer": 2, "n_embd": 8, "names": ["a", "b"]}


def test_an_hf_style_config_is_recorded_as_save_pretrained_writes_it():
    assert model_config_of(WithConfig(JsonConfig())) == {"model_type": "llama", "hidden_size": 32}


def test_no_config_or_one_that_is_not_json_is_left_out():
    assert model_config_of(torch.nn.Linear(2, 2)) is None
    assert model_config_of(WithConfig({"a": 1})) is None  # a plain dict is not a config object
    assert model_config_of(WithConfig(TinyConfig(names=(object(),)))) is None
    assert model_config_of(WithConfig(TinyConfig)) is None  # the class, not an instance
