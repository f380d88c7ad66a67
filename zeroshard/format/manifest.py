"""The checkpoint manifest (`zeroshard.json`): what a checkpoint holds and where each byte lives.

See docs/FORMAT.md for the specification this module implements. Format 1.1 keeps the manifest
O(tensors + ranks): one entry per file and one per tensor. Which rank file holds which elements
follows from each tensor's layout (zeroshard.format.layout); per-fragment hashes live in the
rank files themselves. Version 1.0 manifests, which list every fragment with its hash, are read
into the same objects (their fragment hashes kept aside in `legacy_hashes`).

Parsing validates everything (types, bounds, names, the layout rules) before anything is
allocated on a manifest's say-so, so everything downstream can trust a Manifest object; only the
agreement between manifest and files is left to the readers.
"""

from __future__ import annotations

import functools
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from zeroshard import __version__
from zeroshard.errors import CheckpointError, MissingKeyError
from zeroshard.partition import rank_ranges, shard_range
from zeroshard.storage.hashing import HASH_ALGORITHM
from zeroshard.storage.safetensors_header import DTYPE_SIZES

FORMAT_NAME = "zeroshard-checkpoint"
FORMAT_VERSION = "1.1"
READABLE_VERSIONS = ("1.0", "1.1")  # a higher 1.x only adds keys: read as 1.1
MANIFEST_NAME = "zeroshard.json"
LATEST_NAME = "latest"
# The last tensor of every 1.1 rank file: U64 XXH3 values of its fragments, in data-offset order.
HASH_TABLE_NAME = "__zeroshard_fragment_hashes__"

ROLES = ("param", "buffer", "optimizer", "extra")
# flat: split over every rank by zeroshard.partition; whole: stored once, in rank 0's file;
# local: belongs to one rank (e.g. its RNG state), stored in that rank's file.
LAYOUTS = ("flat", "whole", "local")

# Bounds on what a manifest may ask a reader to believe or allocate.
MAX_MANIFEST_BYTES = 512 * 1024 * 1024  # a 1.0 manifest of 2,048 ranks x 2,100 tensors is ~170 MB
MAX_WORLD_SIZE = 1 << 20
MAX_NAME_CHARS = 4096
MAX_NDIM = 64

_SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_RANK_FILE_NAME = re.compile(r"^rank-\d{5,}-of-\d{5,}\.safetensors$")
_HEX = re.compile(r"^[0-9a-f]{1,64}$")


def rank_file_name(rank: int, world_size: int) -> str:
    """`rank-00003-of-00016.safetensors`: sorts by rank and says the world size."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def is_rank_file_name(name: str) -> bool:
    """Whether `name` looks like a rank file (rank_file_name's pattern)."""
    return bool(_RANK_FILE_NAME.match(name))


def is_safe_file_name(name: str) -> bool:
    """A plain name inside the checkpoint folder: no separators, no `..`, not hidden."""
    return isinstance(name, str) and bool(_SAFE_FILE_NAME.match(name)) and ".." not in name


@dataclass(frozen=True)
class Fragment:
    """Elements [start, end) of a global tensor, stored 1-D under the tensor's name in `rank`'s file."""

    rank: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class _cached(functools.cached_property):
    """functools.cached_property without the lock Python 3.11 takes on every first read (3.12
    dropped it): a 16,384-rank manifest's 20,000 tensors each compute numel and itemsize."""

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.attrname] = self.func(instance)
        return value


@dataclass(frozen=True)
class TensorEntry:
    """A global tensor: what it is and how it is laid out over the rank files."""

    name: str
    role: str
    dtype: str  # safetensors dtype name, e.g. "F32"
    shape: tuple[int, ...]
    layout: str = "flat"
    param: str | None = None  # optimizer state: the parameter it belongs to
    state: str | None = None  # optimizer state: its key, e.g. "exp_avg"
    owner: int = 0  # layout 'local': the rank whose file holds it

    # cached: planning a 1,000-rank reshard asks for these millions of times
    @_cached
    def numel(self) -> int:
        return math.prod(self.shape)

    @_cached
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, entry: "TensorEntry") -> "TensorEntry":
        return entry


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
    client_state: Any = None
    extra: dict[str, Any] = field(default_factory=dict)  # engine state: scheduler, loss scaler, ...
    aliases: dict[str, str] = field(default_factory=dict)  # tied weights: alias name -> stored tensor name
    created_by: str = f"zeroshard {__version__}"
    version: str = FORMAT_VERSION
    # Version 1.0 only: (tensor, rank) -> fragment hash, as its manifest listed them.
    legacy_hashes: dict[tuple[str, int], str] | None = None

    def file_for_rank(self, rank: int) -> FileEntry:
        entry = self.files[rank] if 0 <= rank < len(self.files) else None
        if entry is None or entry.rank != rank:
            entry = next((f for f in self.files if f.rank == rank), None)
        if entry is None:
            raise MissingKeyError(rank)
        return entry

    def to_json(self) -> bytes:
        """Pretty but compact: one line per file and per tensor, so a manifest stays readable."""
        head = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
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
    if t.layout == "local":
        doc["owner"] = t.owner
    if t.param is not None:
        doc["param"], doc["state"] = t.param, t.state
    return doc


# ---- parsing and validation ----------------------------------------------------------------

class _Malformed(ValueError):
    """A field of the wrong type or out of bounds (reported as one line naming the manifest)."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # in C: the hook runs for each of a big manifest's 40,000 objects
    if len(out) != len(pairs):  # some key repeats: name the first that does
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {key!r}")  # internal: json hook, reported as CheckpointError
    return out


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and fully validate manifest bytes; `where` names the file in errors."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(where, f"manifest of {len(raw)} bytes is over the {MAX_MANIFEST_BYTES} byte limit")
    try:
        doc = json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise CheckpointError(where, "manifest is nested too deeply to be a zeroshard manifest") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(where, f"manifest is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointError(where, f"not a zeroshard manifest (format is not {FORMAT_NAME!r})")
    version = doc.get("version")
    if not isinstance(version, str) or version.split(".")[0] != "1" or not re.match(r"^1\.\d{1,4}$", version):
        raise CheckpointError(where, f"format version {str(version)[:40]!r} is not supported (this zeroshard "
                                     f"{__version__} reads version 1.x); upgrade zeroshard")
    try:
        manifest = _build(doc, version)
    except _Malformed as exc:
        raise CheckpointError(where, f"manifest is malformed: {exc}") from None
    problems = check_manifest(manifest)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(where, problems[0] + more)
    return manifest


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: Any, what: str, low: int = 0, high: int = 1 << 62) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Malformed(f"{what} must be an integer, got {_short(value)}")
    if not low <= value <= high:
        raise _Malformed(f"{what} {value} is out of range [{low}, {high}]")
    return value


def _str(value: Any, what: str, limit: int = MAX_NAME_CHARS) -> str:
    if not isinstance(value, str):
        raise _Malformed(f"{what} must be a string, got {_short(value)}")
    if len(value) > limit:
        raise _Malformed(f"{what} is longer than {limit} characters")
    return value


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Malformed(f"{what} must be an object, got {_short(value)}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _Malformed(f"{what} must be an array, got {_short(value)}")
    return value


def _optional(value: Any, check: Any, *args: Any) -> Any:
    return None if value is None else check(value, *args)


def _build(doc: dict[str, Any], version: str) -> Manifest:
    if doc.get("hash_algorithm", HASH_ALGORITHM) != HASH_ALGORITHM:
        raise _Malformed(f"hash algorithm {_short(doc['hash_algorithm'])} is not supported")
    for key in ("world_size", "files", "tensors", "id"):
        if key not in doc:
            raise _Malformed(f"the key {key!r} is missing")
    world_size = _int(doc["world_size"], "world_size", 1, MAX_WORLD_SIZE)
    raw_files = _list(doc["files"], "files")
    if len(raw_files) != world_size:  # checked before anything is sized by world_size
        raise _Malformed(f"files must be exactly one per rank 0..{world_size - 1}, got {len(raw_files)} entries")
    files = []
    for i, f in enumerate(raw_files):
        entry = _file_fast(f)
        if entry is not None:
            files.append(entry)
            continue
        f = _obj(f, f"files[{i}]")
        files.append(FileEntry(_str(f.get("name"), f"files[{i}].name"), _int(f.get("rank"), f"files[{i}].rank"),
                               _int(f.get("size"), f"files[{i}].size"), _str(f.get("hash"), f"files[{i}].hash", 64)))
    legacy = {} if version == "1.0" else None
    tensors: dict[str, TensorEntry] = {}
    for name, t in _obj(doc["tensors"], "tensors").items():
        if type(name) is not str or len(name) > MAX_NAME_CHARS:
            _str(name, "a tensor name")
        tensors[name] = _tensor(name, t if type(t) is dict else _obj(t, f"tensor {name!r}"), world_size, legacy)
    optimizer = _optional(doc.get("optimizer"), _optimizer)
    dtypes = _obj(doc.get("dtypes") or {}, "dtypes")
    aliases = _obj(doc.get("aliases") or {}, "aliases")
    return Manifest(
        world_size=world_size, tensors=tensors, files=files, id=_str(doc["id"], "id", 64),
        zero_stage=_optional(doc.get("zero_stage"), _int, "zero_stage", 0, 3),
        dtypes={_str(k, "a dtypes key"): _str(v, f"dtypes[{k!r}]") for k, v in dtypes.items()},
        step=_optional(doc.get("step"), _int, "step"), tag=_optional(doc.get("tag"), _str, "tag"),
        optimizer=optimizer, client_state=doc.get("client_state"),
        extra=_obj(doc.get("extra") or {}, "extra"), created_by=_str(doc.get("created_by", ""), "created_by"),
        version=version, aliases={_str(k, "an alias"): _str(v, f"aliases[{k!r}]") for k, v in aliases.items()},
        legacy_hashes=legacy,
    )


# The fast paths: the same checks as _int/_str/_list without composing their messages, which
# cost most of a parse (a 16,384-rank manifest lists 16,384 files and as many rank-state blobs,
# and every rank of a load parses it). Anything they do not accept goes the way that names it.

def _file_fast(f: Any) -> FileEntry | None:
    if type(f) is not dict:
        return None
    name, rank, size, digest = f.get("name"), f.get("rank"), f.get("size"), f.get("hash")
    if (type(name) is str and len(name) <= MAX_NAME_CHARS and type(rank) is int and 0 <= rank <= 1 << 62
            and type(size) is int and 0 <= size <= 1 << 62 and type(digest) is str and len(digest) <= 64):
        return FileEntry(name, rank, size, digest)
    return None


def _tensor_fast(name: str, t: Any, world_size: int) -> TensorEntry | None:
    if type(t) is not dict:
        return None
    shape, role, dtype, layout = t.get("shape"), t.get("role"), t.get("dtype"), t.get("layout")
    param, state, owner = t.get("param"), t.get("state"), t.get("owner", 0)
    if (type(shape) is list and len(shape) <= MAX_NDIM and all(type(d) is int and 0 <= d <= 1 << 62 for d in shape)
            and type(role) is str and len(role) <= 64 and type(dtype) is str and len(dtype) <= 64
            and type(layout) is str and len(layout) <= 64
            and (param is None or type(param) is str and len(param) <= MAX_NAME_CHARS)
            and (state is None or type(state) is str and len(state) <= MAX_NAME_CHARS)
            and type(owner) is int and 0 <= owner <= world_size - 1):
        return TensorEntry(name, role, dtype, tuple(shape), layout, param, state, owner)
    return None


def _tensor(name: str, t: dict[str, Any], world_size: int, legacy: dict | None) -> TensorEntry:
    if legacy is None:
        entry = _tensor_fast(name, t, world_size)
        if entry is not None:
            return entry
    what = f"tensor {name!r}"
    shape = tuple(_int(d, f"{what}: a dimension") for d in _list(t.get("shape"), f"{what}: shape"))
    if len(shape) > MAX_NDIM:
        raise _Malformed(f"{what}: {len(shape)} dimensions")
    role, dtype, layout = (_str(t.get(k), f"{what}: {k}", 64) for k in ("role", "dtype", "layout"))
    param = _optional(t.get("param"), _str, f"{what}: param")
    state = _optional(t.get("state"), _str, f"{what}: state")
    if legacy is None:
        owner = _int(t.get("owner", 0), f"{what}: owner", 0, world_size - 1)
        return TensorEntry(name, role, dtype, shape, layout, param, state, owner)
    # 1.0: fragments are listed; they must be exactly what the layout says (checked below),
    # and their hashes are kept for the reader.
    fragments = []
    for item in _list(t.get("fragments"), f"{what}: fragments"):
        item = _list(item, f"{what}: a fragment")
        if len(item) != 4:
            raise _Malformed(f"{what}: a fragment must be [rank, start, end, hash]")
        fragments.append((_int(item[0], f"{what}: fragment rank"), _int(item[1], f"{what}: fragment start"),
                          _int(item[2], f"{what}: fragment end"), _str(item[3], f"{what}: fragment hash", 64)))
    owner = fragments[0][0] if layout == "local" and len(fragments) == 1 else 0
    entry = TensorEntry(name, role, dtype, shape, layout, param, state, owner)
    if layout in LAYOUTS and dtype in DTYPE_SIZES:
        _check_legacy_fragments(entry, fragments, world_size)
    for rank, _, _, digest in fragments:
        legacy[(name, rank)] = digest
    return entry


def _check_legacy_fragments(t: TensorEntry, fragments: list[tuple[int, int, int, str]], world_size: int) -> None:
    """A 1.0 manifest's fragment list must be the one its layout implies (what 1.1 derives)."""
    from zeroshard.partition import check_tiling

    for rank, start, end, _ in fragments:
        if not 0 <= rank < world_size:
            raise _Malformed(f"tensor {t.name!r}: fragment in rank {rank}, outside world size {world_size}")
        if not 0 <= start < end <= t.numel:
            raise _Malformed(f"tensor {t.name!r}: fragment [{start}, {end}) out of range for {t.numel} elements")
    if len({f[0] for f in fragments}) != len(fragments):
        raise _Malformed(f"tensor {t.name!r}: two fragments in one rank's file")
    try:
        check_tiling(((s, e) for _, s, e, _ in fragments), t.numel)
    except ValueError as exc:
        raise _Malformed(f"tensor {t.name!r}: fragments do not cover the tensor exactly once: {exc}") from None
    expected = [(r, s, e) for r, s, e in ((r, *owned_range(t, world_size, r)) for r in range(world_size)) if e > s]
    if sorted((r, s, e) for r, s, e, _ in fragments) != expected:
        raise _Malformed(f"tensor {t.name!r}: fragments do not follow the {t.layout!r} layout "
                         f"for world size {world_size}")


def _optimizer(value: Any) -> dict[str, Any]:
    opt = _obj(value, "optimizer")
    _optional(opt.get("class"), _str, "optimizer.class")
    for i, group in enumerate(_list(opt.get("param_groups") or [], "optimizer.param_groups")):
        group = _obj(group, f"optimizer.param_groups[{i}]")
        for name in _list(group.get("params") or [], f"optimizer.param_groups[{i}].params"):
            _str(name, f"optimizer.param_groups[{i}].params entry")
    scalar = _obj(opt.get("scalar_state") or {}, "optimizer.scalar_state")
    for name, state in scalar.items():
        _obj(state, f"optimizer.scalar_state[{name!r}]")
    return opt


def owned_range(t: TensorEntry, world_size: int, rank: int) -> tuple[int, int]:
    """Elements of `t` that `rank`'s file holds under the format's layout rules."""
    if t.layout == "flat":
        return shard_range(t.numel, world_size, rank)
    holder = t.owner if t.layout == "local" else 0
    return (0, t.numel) if rank == holder else (0, 0)


def rank_contents(tensors: Iterable[TensorEntry], world_size: int, rank: int) -> list[tuple[TensorEntry, int, int]]:
    """(tensor, start, end) for every non-empty fragment of `rank`'s file, in file order."""
    tensors = list(tensors)  # owned_range, for all at once: this runs tensors x ranks times in a reshard
    out = []
    for t, (start, end) in zip(tensors, rank_ranges([t.numel for t in tensors], world_size, rank)):
        if t.layout == "flat":
            if start < end:
                out.append((t, start, end))
        elif t.numel and rank == (t.owner if t.layout == "local" else 0):
            out.append((t, 0, t.numel))
    return out


def check_manifest(m: Manifest) -> list[str]:
    """Every structural problem of a manifest, as messages (empty when it is sound). O(tensors + ranks)."""
    problems: list[str] = []
    if not 1 <= m.world_size <= MAX_WORLD_SIZE:
        return [f"world_size {m.world_size} is out of range [1, {MAX_WORLD_SIZE}]"]
    if len(m.files) != m.world_size or sorted(f.rank for f in m.files) != list(range(m.world_size)):
        return [f"files must be exactly one per rank 0..{m.world_size - 1}"]
    names = [f.name for f in m.files]
    for name in names:
        if not is_safe_file_name(name):
            problems.append(f"file name {name[:80]!r} escapes the checkpoint folder or is not a plain name")
    if len(set(names)) != len(names):
        problems.append("two ranks share one file name")
    for f in m.files:
        if f.size < 8:
            problems.append(f"file {f.name!r} has an impossible size {f.size}")
    for name, t in m.tensors.items():
        problems.extend(f"tensor {name!r}: {p}" for p in _check_tensor(t, m.world_size))
    if problems:
        return problems
    # Nothing a manifest says may size an allocation beyond the bytes its files really hold.
    stored, available = sum(t.nbytes for t in m.tensors.values()), sum(f.size for f in m.files)
    if stored > available:
        problems.append(f"tensors total {stored} bytes but the rank files hold only {available}")
    for alias, target in m.aliases.items():
        if alias in m.tensors or target not in m.tensors:
            problems.append(f"alias {alias!r} -> {target!r} must name a stored tensor and not shadow one")
    return problems


def _check_tensor(t: TensorEntry, world_size: int) -> list[str]:
    if not t.name or t.name == HASH_TABLE_NAME or t.name == "__metadata__":
        return ["the name is empty or reserved"]
    if t.role not in ROLES:
        return [f"unknown role {t.role!r}"]
    if t.layout not in LAYOUTS:
        return [f"unknown layout {t.layout!r}"]
    if t.dtype not in DTYPE_SIZES:
        return [f"unknown dtype {t.dtype!r}"]
    if t.numel > 1 << 62:
        return [f"shape {list(t.shape)} is absurd"]
    if t.role == "optimizer" and (not t.param or not t.state):
        return ["optimizer state must name its param and state"]
    if not 0 <= t.owner < world_size:
        return [f"owner rank {t.owner} is outside world size {world_size}"]
    return []
