"""Reading a checkpoint into memory from Python: no process group, any world size, local or S3.

    import zeroshard
    state = zeroshard.load_state_dict("run/")                 # the weights, as model.state_dict() has them
    with zeroshard.open_tensors("s3://bucket/run") as ckpt:   # lazy: a tensor is read when asked for
        print(ckpt.info("lm_head.weight"), ckpt["lm_head.weight"].shape)

Every byte read is checked against the fragment hashes the writer recorded (as consolidate does).
Tied weights recorded in the manifest appear under each of their names.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.format import CheckpointReader, TensorEntry, open_checkpoint
from zeroshard.format.full_model import strip

if TYPE_CHECKING:
    import torch

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float32": "float32",
          "bfloat16": "bfloat16", "float16": "float16"}


def _torch_dtype(dtype: Any) -> "torch.dtype":
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return getattr(torch, DTYPES[dtype])
    raise ZeroshardError(f"dtype {dtype!r}: use fp32, bf16, fp16 or a torch floating dtype")


def select(names: Iterable[str], include: Iterable[str] | str | None = None,
           exclude: Iterable[str] | str | None = None) -> list[str]:
    """The names matching any `include` glob (all when None) and no `exclude` glob, in order."""
    inc = [include] if isinstance(include, str) else list(include or [])
    exc = [exclude] if isinstance(exclude, str) else list(exclude or [])
    return [n for n in names if (not inc or any(fnmatch.fnmatchcase(n, p) for p in inc))
            and not any(fnmatch.fnmatchcase(n, p) for p in exc)]


class CheckpointTensors(Mapping[str, "torch.Tensor"]):
    """A checkpoint's tensors of some roles as a read-only mapping; each read on access."""

    def __init__(self, path: str, *, roles: Iterable[str] | None = ("param", "buffer"),
                 storage_options: dict | None = None, verify: bool = True):
        """roles: "param" and "buffer" (the model's state_dict), "optimizer", "extra"; None: every tensor."""
        self.location, self.manifest = open_checkpoint(path, storage_options)
        wanted = None if roles is None else set(roles)
        self._entries: dict[str, TensorEntry] = {n: t for n, t in self.manifest.tensors.items()
                                                 if wanted is None or t.role in wanted}
        for alias, target in (self.manifest.aliases or {}).items():
            if target in self._entries and alias not in self._entries:
                self._entries[alias] = self._entries[target]
        self._reader = CheckpointReader(self.location, self.manifest, verify_hashes=verify)

    def info(self, name: str) -> TensorEntry:
        """What the manifest says of `name`: role, dtype, shape, layout (reads no data)."""
        if name not in self._entries:
            raise CheckpointError(self.location.url, f"no tensor {name!r} (it holds {len(self._entries)}; "
                                                     f"`zeroshard inspect --tensors` lists them)")
        return self._entries[name]

    def __getitem__(self, name: str) -> "torch.Tensor":
        entry = self.info(name)
        return self._reader.read_flat(entry).view(entry.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "CheckpointTensors":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_tensors(path: str, *, roles: Iterable[str] | None = ("param", "buffer"), storage_options: dict | None = None,
                 verify: bool = True) -> CheckpointTensors:
    """A lazy per-tensor reader of checkpoint `path` (a folder, or a root following `latest`)."""
    return CheckpointTensors(path, roles=roles, storage_options=storage_options, verify=verify)


def load_state_dict(path: str, names: Iterable[str] | str | None = None, *, exclude: Iterable[str] | str | None = None,
                    dtype: Any = None, strip_prefix: Iterable[str] | str | None = None,
                    roles: Iterable[str] | None = ("param", "buffer"), storage_options: dict | None = None,
                    verify: bool = True) -> dict[str, "torch.Tensor"]:
    """The tensors of checkpoint `path` as full (unsharded) CPU tensors, by name.

    names/exclude: glob patterns (or exact names) choosing tensors; dtype: cast floating tensors
    (fp32, bf16, fp16 or a torch dtype); strip_prefix: removed from names that start with it
    (e.g. "module." or "_orig_mod."). No process group is needed.
    """
    target = None if dtype is None else _torch_dtype(dtype)
    prefixes = [strip_prefix] if isinstance(strip_prefix, str) else list(strip_prefix or [])
    with open_tensors(path, roles=roles, storage_options=storage_options, verify=verify) as tensors:
        chosen = select(tensors, names, exclude)
        if names is not None and not chosen:
            raise CheckpointError(tensors.location.url, f"no tensor matches {names!r}")
        out: dict[str, "torch.Tensor"] = {}
        whole = read_rank_major(tensors._reader, [tensors.info(n) for n in chosen])
        for name in chosen:
            entry = tensors.info(name)
            tensor = whole[entry.name].view(entry.shape) if whole is not None else tensors[name]
            if target is not None and tensor.is_floating_point():
                tensor = tensor.to(target)
            key = strip(name, prefixes)
            if key in out:
                raise CheckpointError(tensors.location.url, f"stripping {prefixes} makes two tensors {key!r}")
            out[key] = tensor
        return out


SMALL_FILE_BYTES = 8 * 1024 * 1024  # rank files up to this size are read whole, once each
SMALL_TOTAL_BYTES = 1024 * 1024 * 1024  # ... when the tensors wanted fit in this much memory


def read_rank_major(reader: CheckpointReader, wanted: Iterable[TensorEntry]) -> dict[str, "torch.Tensor"] | None:
    """Every tensor of `wanted` in full (flat), reading each rank file once, whole, and placing its
    fragments: thousands of small rank files cost one read each instead of one per fragment.
    Only for local checkpoints of small files and a bounded total; None otherwise (read per tensor)."""
    import torch

    from zeroshard.format.reader import fragments_of
    from zeroshard.storage.safetensors_header import torch_dtype
    from zeroshard.toolkit.gather import check_input

    manifest = reader.manifest
    unique = {t.name: t for t in wanted}
    if not reader.location.local or any(f.size > SMALL_FILE_BYTES for f in manifest.files) or \
            sum(t.nbytes for t in unique.values()) > SMALL_TOTAL_BYTES:
        return None
    by_rank: dict[int, list[tuple[TensorEntry, int, int]]] = {}
    for t in unique.values():
        for rank, start, end in fragments_of(t, manifest.world_size):
            by_rank.setdefault(rank, []).append((t, start, end))
    read = sum(manifest.file_for_rank(rank).size for rank in by_rank)
    if read > 4 * sum(t.nbytes for t in unique.values()) + SMALL_FILE_BYTES:
        return None  # a few tensors out of many: whole files would read mostly what is not wanted
    out = {n: torch.empty(t.numel, dtype=torch_dtype(t.dtype)) for n, t in unique.items()}
    views = {n: memoryview(o.view(torch.uint8).numpy()).cast("B") for n, o in out.items()}
    for rank in sorted(by_rank):
        opened = reader.open_file(rank)  # its header checked against the manifest
        whole = memoryview(bytearray(opened.header.file_size))
        opened.reader.read_into(0, whole)
        if reader.verify_hashes:  # the whole file's hash when small, else each fragment used
            check_input(reader, rank, whole, [t.name for t, _, _ in by_rank[rank]])
        for t, start, end in by_rank[rank]:
            entry = opened.header.entries[t.name]
            views[t.name][start * t.itemsize:end * t.itemsize] = whole[entry.begin:entry.end]
    return out
