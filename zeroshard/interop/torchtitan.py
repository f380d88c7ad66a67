"""torchtitan's fused attention projection in its CheckpointManager's DCP checkpoints.

# [Note: torchtitan fused QKV]
torchtitan 0.3.0's llama3 (every model built with fuse_qkv=True) holds one parameter
`<prefix>wqkv.weight` (FusedQKVLinear); a state-dict post hook splits it into `wq`/`wk`/`wv`
and a load pre-hook fuses them back. A CheckpointManager checkpoint therefore holds the split
weights as model entries, while its OptimizersContainer, keyed by named_parameters(), holds
`state.<prefix>wqkv.weight.*` and `param_groups.<prefix>wqkv.weight.*`. The import fuses the
three weights exactly as the load hook does, so the checkpoint holds the parameter under the
name the module has (what an engine resume of torchtitan's model class loads by) and its
moments as the optimizer saved them. The fused rows interleave per KV head (its queries, its
key, its value), which depends on the head size, and no shape tells it (wk has
n_kv_heads * head_dim rows): it is asked for (`--head-dim`).
"""

from __future__ import annotations

from typing import Any

from zeroshard.errors import CheckpointError, ZeroshardError
from zeroshard.interop.imported import materialize


def fused_qkv(where: str, paths: dict[str, tuple], tensors: dict[str, int],
              head_dim: int | None) -> dict[str, tuple[str, str, str]]:
    """The fused names an optimizer entry holds whose split `wq`/`wk`/`wv` are model entries
    (tensors at the top level or under `model`): {"<prefix>wqkv.<param>": (wq, wk, wv)}. Refused
    in one line when there are some and no `head_dim`, or a `head_dim` and none."""
    model = {str(p[-1]) for k, p in paths.items()
             if k in tensors and (len(p) == 1 or (len(p) == 2 and p[0] == "model"))}
    elements = {e for p in paths.values() for e in p[1:] if isinstance(e, str)} | \
               {p[0] for p in paths.values() if len(p) == 1 and isinstance(p[0], str)}
    fused: dict[str, tuple[str, str, str]] = {}
    for fqn in sorted(model):
        module, _, last = fqn.rpartition(".")  # "<stem>wq", "weight"
        if module != "wq" and not module.endswith(".wq"):
            continue
        stem = module[:-2]
        parts = (f"{stem}wq.{last}", f"{stem}wk.{last}", f"{stem}wv.{last}")
        name = f"{stem}wqkv.{last}"
        if name in model or not all(p in model for p in parts):
            continue
        if name in elements or any(e.startswith((f"state.{name}.", f"param_groups.{name}.")) for e in elements):
            fused[name] = parts
    if fused and head_dim is None:
        shown = ", ".join(list(fused)[:2]) + (f" (+{len(fused) - 2} more)" if len(fused) > 2 else "")
        raise CheckpointError(where, f"torchtitan's fused attention: the optimizer holds {shown} while the model "
                                     "entries are its split wq/wk/wv; give --head-dim (the model's head_dim, "
                                     "dim // n_heads unless its config sets it) to fuse them as the module holds them")
    if head_dim is not None and not fused:
        raise ZeroshardError(f"--head-dim applies only to a torchtitan checkpoint whose optimizer holds fused "
                             f"wqkv parameters, and {where} has none")
    if head_dim is not None and head_dim < 1:
        raise ZeroshardError(f"--head-dim {head_dim} is not a positive number")
    return fused


def fuse(where: str, model: dict[str, Any], fused: dict[str, tuple[str, str, str]], head_dim: int) -> dict[str, Any]:
    """`model` with each (wq, wk, wv) replaced by their fusion, at wq's place: torchtitan's
    FusedQKVLinear._merge_qkv_on_load, checked first (See [Note: torchtitan fused QKV])."""
    import torch

    into = {parts[0]: name for name, parts in fused.items()}
    dropped = {p for parts in fused.values() for p in parts[1:]}
    out: dict[str, Any] = {}
    for fqn, value in model.items():
        if fqn in dropped:
            continue
        if fqn not in into:
            out[fqn] = value
            continue
        name = into[fqn]
        wq, wk, wv = (materialize(model[p]) for p in fused[name])
        shapes = " ".join(f"{p.rpartition('.')[0].rpartition('.')[2]} {tuple(t.shape)}"
                          for p, t in zip(fused[name], (wq, wk, wv)))
        bad = (wk.shape != wv.shape or wq.dim() != wk.dim() or wq.dim() not in (1, 2) or wq.shape[1:] != wk.shape[1:]
               or len({wq.dtype, wk.dtype, wv.dtype}) > 1 or wk.shape[0] % head_dim or wq.shape[0] % wk.shape[0])
        if bad:
            raise CheckpointError(where, f"{name}: its split weights ({shapes}) do not fuse with head_dim {head_dim}")
        n_kv, tail = wk.shape[0] // head_dim, tuple(wq.shape[1:])
        per_kv = wq.shape[0] // wk.shape[0]
        out[name] = torch.cat([wq.reshape(n_kv, per_kv, head_dim, *tail), wk.reshape(n_kv, 1, head_dim, *tail),
                               wv.reshape(n_kv, 1, head_dim, *tail)], dim=1).reshape(-1, *tail)
    return out
