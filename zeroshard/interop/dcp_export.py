"""`zeroshard export dcp`: a zeroshard checkpoint as a DCP checkpoint FSDP2 can dcp.load.

The state dict written is {"model": model.state_dict() names (weights, buffers, tied aliases),
"optim": get_optimizer_state_dict's layout ({"state": {fqn: {...}}, "param_groups": [...,
"params": [fqn...]]})}, full (unsharded) tensors, plus every global Stateful state under its own
key ("lr_scheduler": the scheduler's state_dict(), what a script adds to the dict it passes to
dcp.load) and the client state under "client_state", saved by torch.distributed.checkpoint's
own FileSystemWriter in one process (no_dist=True). Per-rank states (RNG streams) have no
place in a full-state export: named by the CLI, not written. DCP reshards full tensors into any FSDP2
layout at load. OUT may be local or a URL (s3://): DCP's writer writes local files, so for a
remote OUT it writes into a local temporary folder whose files are then uploaded through
storage's Location (multipart, bounded retries), `.metadata` last as below. That needs local
disk for one copy of the export (its size: the model and optimizer state, full).

The output goes through the toolkit's output discipline (format.output, docs/SAFETY.md): OUT
may not be, contain or lie inside CKPT; it is claimed; DCP writes into a hidden staging folder
inside OUT (always, so an interrupted export leaves only what `zeroshard clean` removes), and
the files move up with `.metadata`, DCP's commit file, last. An existing OUT stays whole until
the new one is complete.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from typing import Any

from zeroshard.errors import CheckpointError, StorageError
from zeroshard.format import CheckpointReader, open_checkpoint
from zeroshard.format.output import output_transaction, prepare_output
from zeroshard.format.training_state import global_stateful, global_stateful_keys, ranks_with_rank_state
from zeroshard.storage.location import Location, describe_error

DCP_COMMIT_FILE = ".metadata"
TENSOR_KEYS = ("model", "optim")
CLIENT_STATE_KEY = "client_state"


def _scalar(entry: dict[str, Any]) -> Any:
    import torch

    from zeroshard.storage.safetensors_header import torch_dtype

    if "dtype" in entry:
        return torch.tensor(entry["value"], dtype=torch_dtype(entry["dtype"]))
    return entry["value"]


def export_state_dict(ckpt: str, storage_options: dict | None = None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} of the zeroshard checkpoint at `ckpt`, full CPU tensors."""
    ckpt = os.fspath(ckpt)  # any os.PathLike
    location, manifest = open_checkpoint(ckpt, storage_options)
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    with CheckpointReader(location, manifest) as reader:
        for name, entry in manifest.tensors.items():
            if entry.role in ("param", "buffer"):
                model[name] = reader.read_flat(entry).reshape(entry.shape)
            elif entry.role == "optimizer":
                state.setdefault(entry.param, {})[entry.state] = reader.read_flat(entry).reshape(entry.shape)
    for alias, target in manifest.aliases.items():
        model[alias] = model[target]
    optimizer = manifest.optimizer or {}
    for name, scalars in (optimizer.get("scalar_state") or {}).items():
        for key, value in scalars.items():
            state.setdefault(name, {})[key] = _scalar(value)
    groups = []
    for group in optimizer.get("param_groups") or []:
        g = {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in group.items()}
        groups.append(g)
    if not groups and state:
        groups = [{"params": list(state)}]
    optim = {"state": state, "param_groups": groups}
    return {"model": model, "optim": optim, **_also_exported(manifest, location.url)}


def _also_exported(manifest: Any, where: str) -> dict[str, Any]:
    """What the export writes beside the model and optimizer: each global Stateful state under its
    key, the client state under CLIENT_STATE_KEY."""
    beside = {}
    for key in global_stateful_keys(manifest.extra):
        if key in (*TENSOR_KEYS, CLIENT_STATE_KEY):
            raise CheckpointError(where, f"a Stateful state saved as {key!r} would take the DCP key the "
                                         "export writes the model, optimizer or client state under")
        beside[key] = global_stateful(manifest.extra, key)
    if manifest.client_state not in (None, {}):
        beside[CLIENT_STATE_KEY] = manifest.client_state
    return beside


def export_extras(ckpt: str, storage_options: dict | None = None) -> tuple[list[str], int]:
    """What an export of `ckpt` writes beside the model and optimizer (the DCP keys), and how many
    ranks saved per-rank state (RNG streams) that it leaves out."""
    location, manifest = open_checkpoint(os.fspath(ckpt), storage_options)
    return list(_also_exported(manifest, location.url)), ranks_with_rank_state(manifest.tensors)


def _first_failure(exc: Any) -> str:
    """The first underlying error of DCP's CheckpointException, in one line."""
    for failure in exc.failures.values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, BaseException):
            return f"writing the DCP checkpoint failed: {describe_error(cause)}"
    return "writing the DCP checkpoint failed"


UPLOAD_CHUNK = 8 << 20


def _upload(local: Location, name: str, dest: Location) -> None:
    """Copy file `name` of local folder `local` to the same name in `dest`, a chunk at a time."""
    with local.open_reader(name) as reader, dest.atomic_writer(name) as out:
        size = local.size(name)
        for start in range(0, size, UPLOAD_CHUNK):
            out.write(reader.read(start, min(UPLOAD_CHUNK, size - start)))


def _is_dcp_file(name: str) -> bool:
    """Files a DCP FileSystemWriter output is made of (what an overwritten export leaves behind)."""
    return name.endswith(".distcp") or name == DCP_COMMIT_FILE


@output_transaction
def export_dcp(ckpt: str, out: str, *, overwrite: bool = False, storage_options: dict | None = None) -> int:
    """Write `ckpt` as a DCP checkpoint folder `out`; returns the number of tensors written."""
    ckpt, out = os.fspath(ckpt), os.fspath(out)  # any os.PathLike
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    target = Location(out, storage_options)
    source = Location(ckpt, storage_options)
    output = prepare_output(target, overwrite, inputs=[source], stage_always=True)
    state_dict = export_state_dict(ckpt, storage_options)
    with contextlib.ExitStack() as cleanup:
        written = output.stage
        if not written.local:  # DCP's writer writes local files: a local folder first, uploaded below
            written = Location(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="zeroshard-dcp-")))
        try:
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(written.path), no_dist=True)
        except CheckpointException as exc:  # a BaseException whose text is a page of tracebacks
            raise StorageError(out, _first_failure(exc)) from None
        metadata = written.read_bytes(DCP_COMMIT_FILE)
        written.remove(DCP_COMMIT_FILE)  # written again last, by commit, once every data file is in place
        names = [n for n in written.list() if n != DCP_COMMIT_FILE]
        if written is not output.stage:
            for name in names:
                _upload(written, name, output.stage)
    output.commit(names, (DCP_COMMIT_FILE, metadata), uncommit=[DCP_COMMIT_FILE], stale=_is_dcp_file)
    tensors = [v for v in state_dict["model"].values() if torch.is_tensor(v)]
    tensors += [v for s in state_dict["optim"]["state"].values() for v in s.values() if torch.is_tensor(v)]
    return len(tensors)
