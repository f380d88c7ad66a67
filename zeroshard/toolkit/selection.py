"""What consolidate writes: which tensors (include/exclude, strip_prefix, tied-weight aliases),
in which dtype, into which files (one `.safetensors` file or HF's shards). Names only, no numpy:
commands import this at start-up; the pieces are planned by zeroshard.toolkit.plan."""

from __future__ import annotations

import re
from dataclasses import dataclass

from zeroshard.bucketing import greedy_groups
from zeroshard.errors import ZeroshardError
from zeroshard.format.full_model import HF_SINGLE_NAME, split_file_url, stripped_names
from zeroshard.format.manifest import Manifest, TensorEntry
from zeroshard.storage.safetensors_header import DTYPE_SIZES
from zeroshard.toolkit.load import select

CAST_DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class OutputTensor:
    name: str  # name in the output (an alias of a tied weight is written as its own copy)
    source: TensorEntry
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.source.numel * DTYPE_SIZES[self.dtype]


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, '1000' -> 1000 (HF's convention: GB is 1e9)."""
    match = _SIZE.match(text)
    if not match:
        raise ZeroshardError(f"cannot read size {text!r}: use e.g. 5GB, 500MB, 2GiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    base = 1024 if "I" in unit else 1000
    return int(number * base**power)


def plan_shards(tensors: list[OutputTensor], max_bytes: int) -> list[list[OutputTensor]]:
    """HF's greedy split: fill a file until the next tensor would overflow it; a tensor larger
    than the limit gets a file of its own (zeroshard.bucketing, as the engine's buckets)."""
    return greedy_groups(tensors, lambda t: t.nbytes, max_bytes) or [[]]


def model_tensors(url: str, manifest: Manifest, dtype: str | None, include: list[str] | None = None,
                  exclude: list[str] | None = None, strip_prefix: list[str] | None = None) -> list[OutputTensor]:
    """The weights consolidate writes: params and buffers (and aliases of tied weights), cast
    to `dtype` when floating, chosen by include/exclude and renamed by strip_prefix."""
    if dtype is not None and dtype not in CAST_DTYPES:
        raise ZeroshardError(f"--dtype must be one of {', '.join(CAST_DTYPES)}, got {dtype!r}")
    cast = CAST_DTYPES.get(dtype) if dtype else None
    model_entries = [t for t in manifest.tensors.values() if t.role in ("param", "buffer")]
    if not model_entries:
        raise ZeroshardError(f"{url}: the checkpoint holds no model weights")
    tensors = [OutputTensor(e.name, e, cast if cast and e.dtype in _FLOAT_DTYPES else e.dtype) for e in model_entries]
    for alias, target in manifest.aliases.items():
        base = next((t for t in tensors if t.name == target), None)
        if base is not None:
            tensors.append(OutputTensor(alias, base.source, base.dtype))
    return choose(url, tensors, include, exclude, strip_prefix)


def choose(url: str, tensors: list[OutputTensor], include: list[str] | None, exclude: list[str] | None,
           strip_prefix: list[str] | None) -> list[OutputTensor]:
    """The tensors `include`/`exclude` select (load_state_dict's rules), renamed by `strip_prefix`.
    A glob matching no tensor is an error (a typo would otherwise silently change the output)."""
    names = [t.name for t in tensors]
    for flag, globs in (("--include", include), ("--exclude", exclude)):
        for glob in globs or ():
            if not select(names, glob):
                raise ZeroshardError(f"{url}: {flag} {glob!r} matches no tensor (`zeroshard inspect --tensors` "
                                     f"lists the {len(names)} names)")
    chosen = set(select(names, include or None, exclude))
    if not chosen:
        raise ZeroshardError(f"{url}: --include/--exclude leave no tensor to write")
    kept = [t for t in tensors if t.name in chosen]
    return [OutputTensor(new, t.source, t.dtype)
            for t, new in zip(kept, stripped_names(url, [t.name for t in kept], strip_prefix))]


def output_files(out: str, tensors: list[OutputTensor], max_shard_size: str | None,
                 ) -> tuple[list[str], list[list[OutputTensor]], bool]:
    """consolidate's files: (names, tensors per file, single file?): `out` ending .safetensors is
    one file, anything else a folder of HF shards of at most `max_shard_size` (default 5GB)."""
    single_file = out.rstrip("/").endswith(".safetensors")
    if single_file and max_shard_size:
        raise ZeroshardError(f"{out}: --max-shard-size writes HF's sharded layout into a folder; give a folder as OUT")
    if single_file:
        return [split_file_url(out)[1]], [tensors], True
    shards = plan_shards(tensors, parse_size(max_shard_size or "5GB"))
    names = ([HF_SINGLE_NAME] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    return names, shards, False
