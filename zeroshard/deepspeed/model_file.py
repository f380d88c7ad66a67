"""DeepSpeedEngine.save_16bit_model: the full weights in one file, written as safetensors.

DeepSpeed torch.saves the state dict to `save_dir/pytorch_model.bin`. zeroshard writes no
pickles, so the same weights go to a safetensors file instead, and a pickle's name is changed to
say so: `pytorch_model.bin` becomes `model.safetensors` (the name transformers' from_pretrained
looks for), any other `NAME.bin`/`.pt`/`.pth` becomes `NAME.safetensors`. A script that then
calls `from_pretrained(save_dir)` or loads the file by its new name works; one that torch.loads
the old name is told by the warning what to read instead.

The file is streamed: each parameter is gathered to rank 0 and written in turn (one in memory,
where DeepSpeed's holds the whole model), and committed atomically on rank 0 (a file already
there stays valid until then). Every rank learns of a failure on any rank (agree).
"""

from __future__ import annotations

import os
import posixpath
import warnings
from typing import Any

import torch

from zeroshard.agree import agree
from zeroshard.errors import UnsupportedFeatureError
from zeroshard.storage.location import Location
from zeroshard.storage.safetensors_header import dtype_name
from zeroshard.storage.stream_writer import SafetensorsStreamWriter

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def safetensors_name(save_filename: str) -> str:
    """The file name written for DeepSpeed's `save_filename` (see the module docstring)."""
    if save_filename == "pytorch_model.bin":
        return "model.safetensors"
    stem, suffix = posixpath.splitext(save_filename)
    return stem + ".safetensors" if suffix in _PICKLE_SUFFIXES else save_filename


def save_model_file(engine: Any, module: torch.nn.Module, save_dir: str, save_filename: str,
                    exclude_frozen_parameters: bool) -> str:
    """Write `module`'s full state dict (parameters in their own dtype, buffers as the native
    engine's full_state_dict gives them) to save_dir as safetensors; returns the file's path.
    Collective: every rank calls it."""
    name = safetensors_name(os.fspath(save_filename))
    engine.wait_params()  # collective, as this function: the module is read below
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    dtypes = {n: p.dtype for n, p in module.named_parameters(remove_duplicate=False)}
    layout = []
    for key, value in module.state_dict(keep_vars=True).items():
        if not torch.is_tensor(value):
            raise UnsupportedFeatureError(f"save_16bit_model: {key!r} is not a tensor (a module's extra state), "
                                          "which a safetensors file cannot hold")
        if exclude_frozen_parameters and key in frozen:
            continue
        dtype = dtypes[key] if key in dtypes else engine.buffer_dtypes.get(key, value.dtype)
        layout.append((key, dtype, tuple(value.shape)))  # stage 3 keeps a released parameter's shape
    root = engine.rank == 0
    folder = Location(os.fspath(save_dir))
    error: BaseException | None = None
    writer = None
    try:
        if root:
            folder.makedirs()
            writer = SafetensorsStreamWriter(folder, name, [(k, dtype_name(d), s) for k, d, s in layout],
                                             {"format": "pt"})
            writer.__enter__()
    except Exception as exc:  # the gathers below are collective: go on with them, then agree
        error, writer = exc, None
    wanted = {key: dtype for key, dtype, _ in layout}
    for key, value in engine.full_state_items():
        if writer is None or key not in wanted:
            continue
        try:
            data = value.to(wanted[key]).contiguous().view(-1)
            writer.write(memoryview(data.view(torch.uint8).numpy()) if data.numel() else b"")
        except Exception as exc:
            writer.__exit__(type(exc), exc, None)  # the temp file goes; a file already there stays
            error, writer = exc, None
    if writer is not None:
        try:
            writer.__exit__(None, None, None)  # commits: checks every announced byte came
        except Exception as exc:
            error = exc
    agree(error, engine.group, action="save_16bit_model")
    where = folder.url_of(name)
    if root and name != os.fspath(save_filename):
        warnings.warn(f"save_16bit_model: wrote {where} (safetensors: zeroshard writes no pickles) where "
                      f"DeepSpeed writes {save_filename}", stacklevel=3)
    return where
