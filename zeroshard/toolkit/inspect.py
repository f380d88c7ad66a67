"""`zeroshard inspect`: what a checkpoint holds, from its manifest alone (no tensor data read)."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from zeroshard.format import OpenedCheckpoint, opened_checkpoint
from zeroshard.format.training_state import global_stateful_keys, ranks_with_rank_state


def inspect_checkpoint(ckpt: str | OpenedCheckpoint, *, storage_options: dict | None = None) -> dict[str, Any]:
    """A JSON-able summary: world size, stage, step, parameter count, bytes per rank, dtypes, optimizer.
    `ckpt`: a path (any os.PathLike), or a checkpoint the caller opened (format.opened_checkpoint)."""
    opened = opened_checkpoint(ckpt, storage_options)
    location, m = opened.location, opened.manifest
    params = [t for t in m.tensors.values() if t.role == "param"]
    bytes_by_role: dict[str, int] = defaultdict(int)
    dtypes: dict[str, Counter] = defaultdict(Counter)
    for t in m.tensors.values():
        bytes_by_role[t.role] += t.nbytes
        dtypes[t.role][t.dtype] += 1
    optimizer = None
    if m.optimizer:
        groups = m.optimizer.get("param_groups") or []
        optimizer = {
            "class": m.optimizer.get("class"),
            "param_groups": len(groups),
            "hyperparameters": [{k: v for k, v in g.items() if k != "params"} for g in groups],
            "states": sorted({t.state for t in m.tensors.values() if t.role == "optimizer" and t.state}),
        }
    return {
        "location": location.url,
        "format_version": m.version,
        "checkpoint_id": m.id,
        "created_by": m.created_by,
        "world_size": m.world_size,
        "zero_stage": m.zero_stage,
        "step": m.step,
        "tag": m.tag,
        "dtypes": m.dtypes,
        "parameters": sum(t.numel for t in params),
        "parameter_tensors": len(params),
        "tensors": len(m.tensors),
        "tensor_dtypes": {role: dict(counter) for role, counter in dtypes.items()},
        "bytes_by_role": dict(bytes_by_role),
        "total_bytes": sum(f.size for f in m.files),
        "files": [{"rank": f.rank, "name": f.name, "bytes": f.size} for f in m.files],
        "optimizer": optimizer,
        "aliases": m.aliases,
        "client_state_keys": sorted(m.client_state) if isinstance(m.client_state, dict) else [],
        "stateful": global_stateful_keys(m.extra),  # what load_checkpoint(lr_scheduler=...) etc. restore
        "per_rank_state": ranks_with_rank_state(m.tensors),
        "imported_from": m.extra.get("source") if isinstance(m.extra.get("source"), str) else None,
        "import_notes": [n for n in m.extra.get("import_notes") or [] if isinstance(n, str)],
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_summary(info: dict[str, Any]) -> str:
    """The human-readable form of inspect_checkpoint's result."""
    lines = [
        f"checkpoint   {info['location']}",
        f"format       zeroshard {info['format_version']}  (id {info['checkpoint_id'][:12]}, {info['created_by']})",
        f"world size   {info['world_size']}    "
        f"ZeRO stage {info['zero_stage'] if info['zero_stage'] is not None else '-'}"
        f"    step {info['step'] if info['step'] is not None else '-'}    tag {info['tag'] or '-'}",
        f"parameters   {info['parameters']:,} in {info['parameter_tensors']} tensors "
        f"({info['tensors']} tensors in all)",
    ]
    if info["dtypes"]:
        lines.append("dtypes       " + ", ".join(f"{k} {v}" for k, v in info["dtypes"].items()))
    for role, counter in info["tensor_dtypes"].items():
        lines.append(f"  {role:<10} " + ", ".join(f"{n} x {d}" for d, n in counter.items())
                     + f"  ({_human(info['bytes_by_role'][role])})")
    if info["optimizer"]:
        o = info["optimizer"]
        lines.append(f"optimizer    {o['class']}, {o['param_groups']} param group(s), "
                     f"state: {', '.join(o['states']) or '-'}")
    if info["aliases"]:
        lines.append("tied         " + ", ".join(f"{a} -> {t}" for a, t in info["aliases"].items()))
    per_rank = [f"per-rank state of {info['per_rank_state']} rank(s)"] if info["per_rank_state"] else []
    if info["stateful"] or per_rank:
        lines.append("state        " + ", ".join(info["stateful"] + per_rank))
    if info["imported_from"]:
        lines.append(f"imported     from {info['imported_from']}")
        lines.extend(f"  note: {note}" for note in info["import_notes"])
    sizes = [f["bytes"] for f in info["files"]]
    lines.append(f"files        {len(sizes)} rank files, {_human(info['total_bytes'])} in all, "
                 f"{_human(min(sizes))} .. {_human(max(sizes))} per rank")
    for f in info["files"]:
        lines.append(f"  rank {f['rank']:>5}  {f['name']}  {_human(f['bytes'])}")
    return "\n".join(lines)
