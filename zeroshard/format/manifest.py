"""The checkpoint manifest (`zeroshard.json`): what a checkpoint holds and where each byte lives.

See docs/FORMAT.md for the specification this module implements. Parsing validates the
structure completely (types, names, ranges, tiling) so that everything downstream can trust a
Manifest object; only the agreement between manifest and files is left to the readers.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from zeroshard import __version__
from zeroshard.errors import CheckpointError
from zeroshard.partition import check_tiling, shard_ranges
from zeroshard.storage.hashing import HASH_ALGORITHM
from zeroshard.storage.safetensors_header import DTYPE_SIZES

FORMAT_NAME = "zeroshard-checkpoint"
FORMAT_VERSION = "1.0"
MANIFEST_NAME = "zeroshard.json"
LATEST_NAME = "latest"

ROLES = ("param", "buffer", "optimizer", "extra")
# flat: split over every rank by zeroshard.partition; whole: stored once, in rank 0's file;
# local: belongs to one rank (e.g. its RNG state), stored in that rank's file.
LAYOUTS = ("flat", "whole", "local")

_SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def rank_file_name(rank: int, world_size: int) -> str:
    """`rank-00003-of-00016.safetensors`: sorts by rank and says the world size."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


_RANK_FILE_NAME = re.compile(r"^rank-\d{5}-of-\d{5}\.safetensors$")


def is_rank_file_name(name: str) -> bool:
    """Whether `name` looks like a rank file (rank_file_name's pattern)."""
    return bool(_RANK_FILE_NAME.match(name))


def is_safe_file_name(name: str) -> bool:
    """A plain name inside the checkpoint folder: no separators, no `..`, not hidden."""
    return bool(_SAFE_FILE_NAME.match(name)) and ".." not in name


@dataclass(frozen=True)
class Fragment:
    """Elements [start, end) of a global tensor, stored 1-D under the tensor's name in `rank`'s file."""

    rank: int
    start: int
    end: int
    hash: str

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class TensorEntry:
    name: str
    role: str
    dtype: str  # safetensors dtype name, e.g. "F32"
    shape: tuple[int, ...]
    layout: str
    fragments: list[Fragment]
    param: str | None = None  # optimizer state: the parameter it belongs to
    state: str | None = None  # optimizer state: its key, e.g. "exp_avg"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class FileEntry:
    name: str
    rank: int
    size: int
    hash: str


@dataclass
class Manifest:
    world_size: int
    tensors: dict[str, TensorEntry]
    files: list[FileEntry]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    zero_stage: int | None = None
    dtypes: dict[str, str] = field(default_factory=dict)  # e.g. {"compute": "BF16", "master": "F32"}
    step: int | None = None
    tag: str | None = None
    optimizer: dict[str, Any] | None = None  # {"class", "param_groups", "scalar_state"}
    client_state: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # engine state: scheduler, loss scaler, ...
    aliases: dict[str, str] = field(default_factory=dict)  # tied weights: alias name -> stored tensor name
    created_by: str = f"zeroshard {__version__}"
    version: str = FORMAT_VERSION

    def file_for_rank(self, rank: int) -> FileEntry:
        for entry in self.files:
            if entry.rank == rank:
                return entry
        raise KeyError(rank)

    def to_json(self) -> bytes:
        """Pretty but compact: one line per file and per tensor, so a manifest stays readable."""
        head = {
            "format": FORMAT_NAME,
            "version": self.version,
            "id": self.id,
            "created_by": self.created_by,
            "world_size": self.world_size,
            "zero_stage": self.zero_stage,
            "dtypes": self.dtypes,
            "step": self.step,
            "tag": self.tag,
            "hash_algorithm": HASH_ALGORITHM,
        }
        tail = {"aliases": self.aliases, "optimizer": self.optimizer, "client_state": self.client_state,
                "extra": self.extra}
        files = [{"name": f.name, "rank": f.rank, "size": f.size, "hash": f.hash} for f in self.files]
        lines = ["{"]
        lines += [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
        lines += [' "files": [', ",\n".join(f"  {json.dumps(f)}" for f in files), " ],"]
        lines += [' "tensors": {', ",\n".join(f"  {json.dumps(n)}: {json.dumps(_tensor_to_json(t))}"
                                                for n, t in self.tensors.items()), " },"]
        lines += [",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in tail.items()), "}"]
        return ("\n".join(lines) + "\n").encode()


def _tensor_to_json(t: TensorEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"role": t.role, "dtype": t.dtype, "shape": list(t.shape), "layout": t.layout}
    if t.param is not None:
        doc["param"], doc["state"] = t.param, t.state
    doc["fragments"] = [[f.rank, f.start, f.end, f.hash] for f in t.fragments]
    return doc


# ---- parsing and validation ----------------------------------------------------------------

def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and fully validate manifest bytes; `where` names the file in errors."""
    try:
        doc = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(where, f"manifest is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointError(where, f"not a zeroshard manifest (format is not {FORMAT_NAME!r})")
    version = str(doc.get("version", ""))
    major = version.split(".")[0]
    if major != FORMAT_VERSION.split(".")[0]:
        raise CheckpointError(where, f"format version {version!r} is not supported (this zeroshard "
                                     f"{__version__} reads version {FORMAT_VERSION.split('.')[0]}.x); upgrade zeroshard")
    try:
        manifest = _build(doc, version)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(where, f"manifest is malformed: {exc}") from None
    problems = check_manifest(manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(where, problems[0] + more)
    return manifest


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return value


def _build(doc: dict[str, Any], version: str) -> Manifest:
    if doc.get("hash_algorithm", HASH_ALGORITHM) != HASH_ALGORITHM:
        raise ValueError(f"hash algorithm {doc['hash_algorithm']!r} is not supported")
    files = [FileEntry(str(f["name"]), _int(f["rank"], "file rank"), _int(f["size"], "file size"), str(f["hash"]))
             for f in doc["files"]]
    tensors: dict[str, TensorEntry] = {}
    for name, t in doc["tensors"].items():
        fragments = [Fragment(_int(r, "fragment rank"), _int(s, "fragment start"), _int(e, "fragment end"), str(h))
                     for r, s, e, h in t["fragments"]]
        tensors[name] = TensorEntry(
            name=name, role=t["role"], dtype=t["dtype"], layout=t["layout"],
            shape=tuple(_int(d, f"shape of {name!r}") for d in t["shape"]),
            fragments=fragments, param=t.get("param"), state=t.get("state"),
        )
    step = doc.get("step")
    return Manifest(
        world_size=_int(doc["world_size"], "world_size"), tensors=tensors, files=files, id=str(doc["id"]),
        zero_stage=doc.get("zero_stage"), dtypes=dict(doc.get("dtypes") or {}),
        step=None if step is None else _int(step, "step"), tag=doc.get("tag"),
        optimizer=doc.get("optimizer"), client_state=doc.get("client_state"), extra=dict(doc.get("extra") or {}),
        created_by=str(doc.get("created_by", "")), version=version,
        aliases={str(k): str(v) for k, v in (doc.get("aliases") or {}).items()},
    )


def check_manifest(m: Manifest) -> list[str]:
    """Every structural problem of a manifest, as messages (empty when it is sound)."""
    problems: list[str] = []
    if m.world_size < 1:
        problems.append(f"world_size {m.world_size} is not positive")
    ranks = sorted(f.rank for f in m.files)
    if ranks != list(range(m.world_size)):
        problems.append(f"files must be exactly one per rank 0..{m.world_size - 1}, got ranks {ranks}")
    names = [f.name for f in m.files]
    for name in names:
        if not is_safe_file_name(name):
            problems.append(f"file name {name!r} escapes the checkpoint folder or is not a plain name")
    if len(set(names)) != len(names):
        problems.append("two ranks share one file name")
    for f in m.files:
        if f.size < 8:
            problems.append(f"file {f.name!r} has an impossible size {f.size}")
    for name, t in m.tensors.items():
        problems.extend(f"tensor {name!r}: {p}" for p in _check_tensor(t, m.world_size))
    for alias, target in m.aliases.items():
        if alias in m.tensors or target not in m.tensors:
            problems.append(f"alias {alias!r} -> {target!r} must name a stored tensor and not shadow one")
    return problems


def _check_tensor(t: TensorEntry, world_size: int) -> list[str]:
    if t.role not in ROLES:
        return [f"unknown role {t.role!r}"]
    if t.layout not in LAYOUTS:
        return [f"unknown layout {t.layout!r}"]
    if t.dtype not in DTYPE_SIZES:
        return [f"unknown dtype {t.dtype!r}"]
    if any(d < 0 for d in t.shape):
        return [f"negative dimension in shape {list(t.shape)}"]
    if t.role == "optimizer" and (not t.param or not t.state):
        return ["optimizer state must name its param and state"]
    problems = []
    for f in t.fragments:
        if not 0 <= f.rank < world_size:
            problems.append(f"fragment in rank {f.rank}, outside world size {world_size}")
        if not 0 <= f.start < f.end <= t.numel:
            problems.append(f"fragment [{f.start}, {f.end}) out of range for {t.numel} elements")
    if len({f.rank for f in t.fragments}) != len(t.fragments):
        problems.append("two fragments in one rank's file")
    if problems:
        return problems
    try:
        check_tiling(((f.start, f.end) for f in t.fragments), t.numel)
    except ValueError as exc:
        return [f"fragments do not cover the tensor exactly once: {exc}"]
    if t.layout == "flat":
        expected = [(r, s, e) for r, (s, e) in enumerate(shard_ranges(t.numel, world_size)) if e > s]
        if sorted((f.rank, f.start, f.end) for f in t.fragments) != expected:
            problems.append(f"fragments do not follow the flat partition rule for world size {world_size}")
    elif t.layout == "whole" and t.numel and [f.rank for f in t.fragments] != [0]:
        problems.append("a 'whole' tensor must be stored in rank 0's file")
    elif t.layout == "local" and len(t.fragments) > 1:
        problems.append("a 'local' tensor must be stored in a single rank's file")
    return problems
