"""Do all ranks hold the same model, built the same way, under the same config? Checked in
`initialize` before any collective whose sizes or order depend on it.

A rank whose model differs would otherwise enter other collectives than its peers: a rank
building under `zero_init()` broadcasts no parameters where an eager one broadcasts all, and
one extra parameter shifts every bucket. gloo then aborts the process ("gloo::EnforceNotMet:
Received data size doesn't match expected size") or every rank hangs. So each rank first sends
a small fixed-size digest (one integer per aspect: config, how it was built, parameter count,
names, shapes, dtypes, requires_grad, buffers) through `agree`; only when some differ do all
ranks exchange their full descriptions, to say exactly what differs. Every rank computes the
same message from the same gathered data, so all raise the same error.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist
from torch import nn

from zeroshard.agree import agree, gather_all, rank_groups, ranks_text
from zeroshard.engine.config import ConfigError, ZeroConfig
from zeroshard.errors import RanksBuiltDifferentModelsError

ACTION = "zeroshard.initialize"
_GROUPS_SHOWN = 3  # at thousands of ranks the first few differing groups say enough


def _h(value: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "big") >> 1


def how_built(model: nn.Module) -> str:
    """How the model's tensors were made, in words that finish 'rank 1 built the model ...'."""
    params = list(model.parameters())
    meta = sum(p.is_meta for p in params)
    meta_buffers = sum(b.is_meta for b in model.buffers())
    if meta == 0 and meta_buffers == 0:
        return "eagerly"
    if meta == len(params) and all(getattr(p, "_zeroshard_zero_init", False) for p in params):
        how = "under zero_init()"
    elif meta == len(params):
        how = "on the meta device"
    else:
        how = f"with {meta} of its {len(params)} parameters on the meta device"
    plural = "s" if meta_buffers > 1 else ""
    return how + (f" ({meta_buffers} buffer{plural} on the meta device too)" if meta_buffers else "")


def _details(model: nn.Module, cfg: ZeroConfig) -> dict[str, Any]:
    return {"config": json.dumps(cfg.to_dict(), sort_keys=True, default=str), "build": how_built(model),
            "params": [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
            "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]}


def digest(model: nn.Module, cfg: ZeroConfig) -> tuple[int, ...]:
    """One integer per aspect that must be equal on every rank (fixed size, whatever the model)."""
    d = _details(model, cfg)
    params = d["params"]
    return (cfg.digest(), _h(d["build"]), len(params), _h([p[0] for p in params]), _h([p[1] for p in params]),
            _h([p[2] for p in params]), _h([p[3] for p in params]), _h(d["buffers"]))


def agree_on_build(error: BaseException | None, model: nn.Module, cfg: ZeroConfig | None, group: Any = None) -> None:
    """Raise on every rank if any rank failed (agree), or has another config (ConfigError) or
    another model or way of building it (RanksBuiltDifferentModelsError: every rank must build the same model);
    both name the ranks and the difference."""
    digests = agree(error, group, action=ACTION, payload=None if error is not None else digest(model, cfg))
    if len(set(digests)) == 1:
        return
    assert cfg is not None  # no rank failed, so every rank has its config
    (first_ranks, _), *others = rank_groups(digests)
    # Only the first rank of each group sends its description: at thousands of ranks, a few copies.
    leaders = {first_ranks[0]} | {g[0] for g, _ in others[:_GROUPS_SHOWN]}
    mine = _details(model, cfg) if dist.get_rank(group) in leaders else None
    details = gather_all(mine, group, action=ACTION)
    reference = details[0]
    ref_who = ranks_text(first_ranks)
    configs_differ = [ranks for ranks, d in others if d[0] != digests[0][0]]
    if configs_differ:
        ranks = sorted(r for group_ranks in configs_differ for r in group_ranks)
        what = "; ".join(_config_difference(details[g[0]]["config"], reference["config"], ranks_text(g))
                         for g in configs_differ[:_GROUPS_SHOWN])
        raise ConfigError(f"the zeroshard config differs between rank 0 and rank(s) {ranks}: {what}; "
                          "every rank must use the same config")
    what = "; ".join(_model_difference(details[g[0]], reference, ranks_text(g), ref_who)
                     for g, _ in others[:_GROUPS_SHOWN])
    more = f" (and {len(others) - _GROUPS_SHOWN} more groups of ranks)" if len(others) > _GROUPS_SHOWN else ""
    raise RanksBuiltDifferentModelsError(f"{ACTION}: ranks built different models: {what}{more}; "
                                         "every rank must build the same model the same way")


def _config_difference(mine: str, ref: str, who: str) -> str:
    def flat(doc: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(doc, dict):
            return {prefix: doc}
        out: dict[str, Any] = {}
        for k, v in doc.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else k))
        return out
    a, b = flat(json.loads(mine)), flat(json.loads(ref))
    key = next((k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)), "?")
    return f"{key} is {_short(a.get(key))} on {who}, {_short(b.get(key))} on rank 0"


def _model_difference(mine: dict[str, Any], ref: dict[str, Any], who: str, ref_who: str) -> str:
    """The first way `mine` (ranks `who`) differs from rank 0's `ref`, in one phrase."""
    if mine["build"] != ref["build"]:
        return f"{who} built the model {mine['build']}, {ref_who} {ref['build']}"
    for kind, index in (("parameter", "params"), ("buffer", "buffers")):
        a, b = mine[index], ref[index]
        if a == b:
            continue
        names_a, names_b = [x[0] for x in a], [x[0] for x in b]
        counts = f"{who} has {len(a)} {kind}s, {ref_who} {len(b)}" if len(a) != len(b) else ""
        if names_a != names_b:
            only_a = [n for n in names_a if n not in set(names_b)]
            only_b = [n for n in names_b if n not in set(names_a)]
            if only_a or only_b:
                name, holder = (only_a[0], who) if only_a else (only_b[0], ref_who)
                first = f"{kind} {name[:120]!r} is on {holder} only"
            else:
                first = f"{kind}s are registered in another order on {who} than on {ref_who}"
            return f"{counts} ({first})" if counts else first
        for (name, *x), (_, *y) in zip(a, b):
            for label, u, v in zip(("shape", "dtype", "requires_grad"), x, y):
                if u != v:
                    return f"{kind} {name[:120]!r} has {label} {_short(u)} on {who}, {_short(v)} on {ref_who}"
    return f"{who} differ from {ref_who}"  # a hash collision's mirror image: digests differ, details agree


def _short(value: Any) -> str:
    text = str(list(value)) if isinstance(value, tuple) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
