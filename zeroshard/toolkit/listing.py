"""`zeroshard ls` and `zeroshard inspect --tensors`: what a root and a checkpoint hold, from
manifests and folder listings alone (no tensor data read)."""

from __future__ import annotations

from typing import Any

from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.format import OpenedCheckpoint, opened_checkpoint
from zeroshard.format.folder import MAX_LATEST_BYTES, load_manifest
from zeroshard.format.manifest import LATEST_NAME, MANIFEST_NAME, is_rank_file_name
from zeroshard.interop.sources import foreign_checkpoint_kind
from zeroshard.storage.claim import CLAIM_NAME, is_torn, read_claim, silent_for, writer_alive
from zeroshard.storage.location import TEMP_PREFIX, Location
from zeroshard.toolkit.load import select


def list_tensors(ckpt: str | OpenedCheckpoint, pattern: str = "*", *,
                 storage_options: dict | None = None) -> list[dict[str, Any]]:
    """Name, role, dtype, shape and layout of each tensor whose name matches `pattern` (a glob)."""
    manifest = opened_checkpoint(ckpt, storage_options).manifest
    rows = []
    for name in select(manifest.tensors, pattern):
        t = manifest.tensors[name]
        row = _row(t) if t.layout != "local" else {**_row(t), "layout": f"local (rank {t.owner})"}
        if t.param:
            row["param"], row["state"] = t.param, t.state
        rows.append(row)
    for alias, target in (manifest.aliases or {}).items():
        if select([alias], pattern) and target in manifest.tensors:
            rows.append({**_row(manifest.tensors[target]), "name": alias, "layout": f"tied to {target}"})
    return rows


def _row(t: Any) -> dict[str, Any]:
    return {"name": t.name, "role": t.role, "dtype": t.dtype, "shape": list(t.shape), "layout": t.layout}


def format_tensors(rows: list[dict[str, Any]]) -> str:
    """One aligned line per tensor."""
    if not rows:
        return "no tensor matches"
    width = min(max(len(r["name"]) for r in rows), 80)
    lines = [f"{'name':<{width}}  {'role':<9}  {'dtype':<5}  {'shape':<18}  layout"]
    for r in rows:
        shape = "x".join(map(str, r["shape"])) or "scalar"
        lines.append(f"{r['name']:<{width}}  {r['role']:<9}  {r['dtype']:<5}  {shape:<18}  {r['layout']}")
    return "\n".join(lines)


def list_checkpoints(root: str, *, storage_options: dict | None = None) -> dict[str, Any]:
    """The checkpoints under `root`: committed ones (tag, step, world size, stage, bytes), the one
    `latest` names, and folders that are not checkpoints (incomplete saves, staging leftovers)."""
    location = Location(root, storage_options)
    if not location.exists():
        raise CheckpointError(location.url, "no such folder")
    if location.exists(MANIFEST_NAME):  # a checkpoint itself, not a root
        entries, latest = [_describe(location, location.url.rstrip("/").rsplit("/", 1)[-1])], None
    else:
        latest = None
        if location.exists(LATEST_NAME):
            latest = location.read_bytes(LATEST_NAME, 0, MAX_LATEST_BYTES).decode("utf-8", "replace").strip()
        entries = [_describe(location.child(name), name) for name in location.list()
                   if name != LATEST_NAME and location.isdir(name)]
    for e in entries:
        e["latest"] = e["name"] == latest
    if latest is not None and not any(e["latest"] and e["status"] == "committed" for e in entries):
        entries.append({"name": latest, "status": "missing", "latest": True,
                        "problem": f"{LATEST_NAME} names it but it holds no {MANIFEST_NAME}"})
    return {"location": location.url, "latest": latest, "checkpoints": entries}


def _describe(folder: Location, name: str) -> dict[str, Any]:
    if name.startswith(TEMP_PREFIX):
        return {"name": name, "status": "orphaned", "problem": "a staging folder of an interrupted writer "
                                                               "(zeroshard clean lists and removes these)"}
    if folder.exists(MANIFEST_NAME):
        try:
            m = load_manifest(folder)
        except ZeroshardError as exc:
            return {"name": name, "status": "corrupt", "problem": str(exc)}
        return {"name": name, "status": "committed", "tag": m.tag, "step": m.step, "world_size": m.world_size,
                "zero_stage": m.zero_stage, "bytes": sum(f.size for f in m.files),
                "parameters": sum(t.numel for t in m.tensors.values() if t.role == "param")}
    names = folder.list()
    ranks = [n for n in names if is_rank_file_name(n)]
    if CLAIM_NAME in names:  # a save's folder (docs/SAFETY.md, section 3)
        why = _claim_state(read_claim(folder))
        return {"name": name, "status": "incomplete",
                "problem": f"{len(ranks)} rank file(s), no {MANIFEST_NAME}: {why}"}
    if ranks or any(n.startswith(TEMP_PREFIX) for n in names):
        return {"name": name, "status": "incomplete",
                "problem": f"{len(ranks)} rank file(s) but no {MANIFEST_NAME}: the save never committed"}
    kind = foreign_checkpoint_kind(folder)
    if kind is not None:  # what a user coming from DeepSpeed or FSDP lists first
        return {"name": name, "status": "foreign", "problem": f"{kind[0]}: `zeroshard import {kind[1]} {kind[2]} OUT`"}
    return {"name": name, "status": "other", "problem": "not a checkpoint"}


def _claim_state(doc: dict[str, Any]) -> str:
    """What the claim in an uncommitted folder says of its writer."""
    if is_torn(doc):
        return "a torn save: its writer stopped without committing (zeroshard clean removes it)"
    alive, silent = writer_alive(doc), silent_for(doc)
    if alive is False:
        return "its writer is gone (zeroshard clean removes it)"
    if alive is True:
        return "being written"
    if silent is not None:
        return f"being written on another host (last heartbeat {max(silent, 0.0):.0f} s ago)"
    return "being written, or its writer was killed (zeroshard clean tells which and removes it then)"


def format_listing(info: dict[str, Any]) -> str:
    from zeroshard.toolkit.inspect import _human

    lines = [f"{info['location']}"]
    for e in info["checkpoints"]:
        mark = "*" if e.get("latest") else " "
        if e["status"] == "committed":
            stage = e["zero_stage"] if e["zero_stage"] is not None else "-"
            step = e["step"] if e["step"] is not None else "-"
            lines.append(f"{mark} {e['name']:<24} step {step:<8} world {e['world_size']:<5} stage {stage}  "
                         f"{e['parameters']:>14,} params  {_human(e['bytes']):>11}")
        else:
            lines.append(f"{mark} {e['name']:<24} {e['status'].upper()}: {e['problem']}")
    if len(lines) == 1:
        lines.append("  (no checkpoints)")
    if info["latest"]:
        lines.append(f"* = latest ({info['latest']})")
    return "\n".join(lines)
