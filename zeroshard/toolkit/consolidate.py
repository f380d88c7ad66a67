"""`zeroshard consolidate`: the full model's weights out of a sharded checkpoint.

Output is one `.safetensors` file, or HF's sharded layout (`model-00001-of-0000N.safetensors`
plus `model.safetensors.index.json`). The output header is computed from the manifest up front;
then each tensor's bytes are streamed from the rank files in order through one copy buffer.
Without a dtype cast the output bytes are the stored bytes: bit-exact.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from zeroshard.errors import ZeroshardError
from zeroshard.format import CheckpointReader, open_checkpoint
from zeroshard.format.manifest import TensorEntry
from zeroshard.format.output import PreparedOutput, output_transaction, prepare_file_output, prepare_output
from zeroshard.storage.location import Location
from zeroshard.storage.safetensors_header import DTYPE_SIZES, torch_dtype
from zeroshard.storage.stream_writer import SafetensorsStreamWriter
from zeroshard.toolkit.progress import byte_bar
from zeroshard.format.full_model import HF_INDEX_NAME, HF_SINGLE_NAME, split_file_url

CAST_DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, '1000' -> 1000 (HF's convention: GB is 1e9)."""
    match = _SIZE.match(text)
    if not match:
        raise ZeroshardError(f"cannot read size {text!r}: use e.g. 5GB, 500MB, 2GiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    base = 1024 if "I" in unit else 1000
    return int(number * base**power)


@dataclass(frozen=True)
class OutputTensor:
    name: str  # name in the output (an alias of a tied weight is written as its own copy)
    source: TensorEntry
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.source.numel * DTYPE_SIZES[self.dtype]


def plan_shards(tensors: list[OutputTensor], max_bytes: int) -> list[list[OutputTensor]]:
    """HF's greedy split: fill a file until the next tensor would overflow it; a tensor larger
    than the limit gets a file of its own."""
    shards: list[list[OutputTensor]] = [[]]
    used = 0
    for tensor in tensors:
        if shards[-1] and used + tensor.nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(tensor)
        used += tensor.nbytes
    return shards


@output_transaction
def consolidate(ckpt: str, out: str, *, dtype: str | None = None, max_shard_size: str | None = None,
                overwrite: bool = False, storage_options: dict | None = None, quiet: bool = True) -> list[str]:
    """Write the model's weights at `out`; returns the URLs of the files written."""
    source, manifest = open_checkpoint(ckpt, storage_options)
    if dtype is not None and dtype not in CAST_DTYPES:
        raise ZeroshardError(f"--dtype must be one of {', '.join(CAST_DTYPES)}, got {dtype!r}")
    cast = CAST_DTYPES.get(dtype) if dtype else None
    tensors = []
    model_entries = [t for t in manifest.tensors.values() if t.role in ("param", "buffer")]
    if not model_entries:
        raise ZeroshardError(f"{source.url}: the checkpoint holds no model weights")
    for entry in model_entries:
        tensors.append(OutputTensor(entry.name, entry, cast if cast and entry.dtype in _FLOAT_DTYPES else entry.dtype))
    for alias, target in manifest.aliases.items():
        base = next((t for t in tensors if t.name == target), None)
        if base is not None:
            tensors.append(OutputTensor(alias, base.source, base.dtype))

    single_file = out.rstrip("/").endswith(".safetensors")
    if single_file and max_shard_size:
        raise ZeroshardError(f"{out}: --max-shard-size writes HF's sharded layout into a folder; give a folder as OUT")
    inputs = [Location(ckpt, storage_options), source]
    if single_file:  # one file, replaced atomically: the old one stays until the new one is complete
        folder, names = Location(split_file_url(out)[0], storage_options), [split_file_url(out)[1]]
        prepare_file_output(folder, names[0], overwrite, inputs)  # identity, dead temps (docs/SAFETY.md)
        shards, output = [tensors], None
    else:
        folder = Location(out, storage_options)
        output = prepare_output(folder, overwrite, inputs)  # identity, claim, stage (docs/SAFETY.md)
        shards = plan_shards(tensors, parse_size(max_shard_size or "5GB"))
        count = len(shards)
        names = [HF_SINGLE_NAME] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]

    total = sum(t.nbytes for t in tensors)
    written = []
    with CheckpointReader(source, manifest) as reader, byte_bar(total, "consolidate", quiet) as bar:
        for name, shard_tensors in zip(names, shards):
            layout = [(t.name, t.dtype, t.source.shape) for t in shard_tensors]
            with SafetensorsStreamWriter(output.stage if output else folder, name, layout, {"format": "pt"}, write_behind=True) as writer:
                for tensor in shard_tensors:
                    for chunk in reader.iter_range(tensor.source, 0, tensor.source.numel):
                        data = _cast(chunk, tensor.source.dtype, tensor.dtype)
                        writer.write(data)
                        bar.update(len(data))
            written.append(folder.url_of(name))
    if output is not None:
        _finish_folder(output, names, shards, total)
    return written


def _cast(chunk: memoryview, src: str, dst: str) -> memoryview:
    if src == dst:
        return chunk
    import warnings

    import torch

    with warnings.catch_warnings():  # a read-only view of the page cache: only read, never written
        warnings.simplefilter("ignore", UserWarning)
        values = torch.frombuffer(chunk, dtype=torch_dtype(src)).to(torch_dtype(dst))
    return memoryview(values.view(torch.uint8).numpy())


def _finish_folder(output: PreparedOutput, names: list[str], shards: list[list[OutputTensor]], total: int) -> None:
    """Commit HF's layout: the index last (it vouches for the files); files of an older export removed."""
    index = None
    if len(names) > 1:
        weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
        index = (HF_INDEX_NAME, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode())
    stale = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
    output.commit(names, index, uncommit=[HF_INDEX_NAME], stale=lambda n: bool(stale.match(n)))
