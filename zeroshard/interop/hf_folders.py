"""The names Hugging Face's Trainer and Accelerate give what they save without DeepSpeed or
FSDP, and the Trainer's `checkpoint-N` folders: told apart by names alone (the recognisers in
sources.py, and the readers that refuse or follow them)."""

from __future__ import annotations

import re

from zeroshard.format.full_model import HF_INDEX_NAME, HF_SINGLE_NAME

_TRAINER_CHECKPOINT = re.compile(r"checkpoint-\d{1,12}")  # a Trainer output_dir's checkpoint-N folders


def trainer_checkpoints(names: list[str]) -> list[str]:
    """The Hugging Face Trainer's `checkpoint-N` names among `names`, oldest (smallest N) first."""
    return sorted((n for n in names if _TRAINER_CHECKPOINT.fullmatch(n)), key=lambda n: int(n[len("checkpoint-"):]))


def is_trainer_checkpoint(names: list[str]) -> bool:
    """Whether a folder holding `names` is a Hugging Face Trainer checkpoint written without
    DeepSpeed or FSDP: the full model's weights beside torch's optimizer state dict."""
    return "optimizer.pt" in names and (HF_SINGLE_NAME in names or HF_INDEX_NAME in names)


def is_accelerate_plain(names: list[str]) -> bool:
    """Whether a folder holding `names` is Accelerate's save_state without FSDP or DeepSpeed: the
    model's weights beside torch's optimizer state dict (accelerate_plain.py)."""
    return HF_SINGLE_NAME in names and "optimizer.bin" in names
