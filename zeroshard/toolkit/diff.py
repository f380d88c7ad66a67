"""`zeroshard diff A B`: how far apart two checkpoints' tensors are, whatever their world sizes.

Each tensor present in both is read from both in aligned windows of at most WINDOW_ELEMENTS
elements (hash-checked as consolidate reads), so memory stays bounded whatever the model size;
checkpoints of many small local rank files (up to 1 GiB of tensors) are read whole, each file once.
Closeness is torch.allclose's: |a - b| <= atol + rtol * |b| for every element.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from zeroshard.format import CheckpointReader, open_checkpoint
from zeroshard.toolkit.load import read_rank_major, select

WINDOW_ELEMENTS = 4 * 1024 * 1024  # 32 MiB per side as float64


@dataclass
class TensorDiff:
    name: str
    max_abs: float
    max_rel: float
    close: bool


@dataclass
class DiffReport:
    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # same name, other shape or dtype

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.mismatched) and all(t.close for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "equal": self.equal, "only_in_a": self.only_a, "only_in_b": self.only_b,
                "mismatched": self.mismatched,
                "tensors": [{"name": t.name, "max_abs": t.max_abs, "max_rel": t.max_rel, "close": t.close}
                            for t in self.tensors]}


def diff(a: str, b: str, *, atol: float = 0.0, rtol: float = 0.0, roles: Iterable[str] | None = ("param",),
         include: Iterable[str] | str | None = None, storage_options: dict | None = None) -> DiffReport:
    """Compare checkpoints `a` and `b` tensor by tensor (roles: None for every tensor)."""
    import torch

    loc_a, man_a = open_checkpoint(a, storage_options)
    loc_b, man_b = open_checkpoint(b, storage_options)
    wanted = None if roles is None else set(roles)

    def names(manifest: Any) -> list[str]:
        # per-rank items (RNG states) are tied to their world size: never compared
        return select([n for n, t in manifest.tensors.items() if t.layout != "local"
                       and (wanted is None or t.role in wanted)], include)

    names_a, names_b = names(man_a), names(man_b)
    report = DiffReport(loc_a.url, loc_b.url, only_a=sorted(set(names_a) - set(names_b)),
                        only_b=sorted(set(names_b) - set(names_a)))
    both = [n for n in names_a if n in man_b.tensors]
    with CheckpointReader(loc_a, man_a) as ra, CheckpointReader(loc_b, man_b) as rb:
        # many small local rank files: each read once, whole (load.read_rank_major); else windows per tensor
        whole_a = read_rank_major(ra, [man_a.tensors[n] for n in both])
        whole_b = read_rank_major(rb, [man_b.tensors[n] for n in both]) if whole_a is not None else None
        for name in both:
            ta, tb = man_a.tensors[name], man_b.tensors[name]
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                report.mismatched.append(f"{name}: {ta.dtype}{list(ta.shape)} against {tb.dtype}{list(tb.shape)}")
                continue
            max_abs = max_rel = 0.0
            close = True
            for start in range(0, ta.numel, WINDOW_ELEMENTS):
                end = min(start + WINDOW_ELEMENTS, ta.numel)
                if whole_a is not None and whole_b is not None:
                    x, y = whole_a[name][start:end], whole_b[name][start:end]
                else:
                    x, y = ra.read_flat(ta, start, end), rb.read_flat(tb, start, end)
                if x.is_floating_point() or x.is_complex():  # complex: |x - y| is the distance in the plane
                    wide = torch.complex128 if x.is_complex() else torch.float64
                    x, y = x.to(wide), y.to(wide)
                    both_nan = x.isnan() & y.isnan()  # NaN where both have NaN counts as equal (equal_nan)
                    x, y = torch.where(both_nan, 0.0, x), torch.where(both_nan, 0.0, y)
                else:
                    x, y = x.long(), y.long()
                delta = (x - y).abs().double()
                scale = y.abs().double()
                if delta.numel():
                    max_abs = max(max_abs, float(delta.max()))
                    rel = torch.where(delta == 0, 0.0, delta / scale.clamp_min(torch.finfo(torch.float64).tiny))
                    max_rel = max(max_rel, float(rel.max()))
                    close = close and bool((delta <= atol + rtol * scale).all())
            report.tensors.append(TensorDiff(name, max_abs, max_rel, close))
    return report


def format_report(report: DiffReport, show_all: bool = False) -> str:
    lines = []
    for t in report.tensors:
        if show_all or not t.close:
            lines.append(f"{'same' if t.close else 'DIFF'}  {t.name}  max abs {t.max_abs:.3g}  max rel {t.max_rel:.3g}")
    lines += [f"ONLY IN A  {n}" for n in report.only_a] + [f"ONLY IN B  {n}" for n in report.only_b]
    lines += [f"MISMATCH  {m}" for m in report.mismatched]
    differing = sum(not t.close for t in report.tensors) + len(report.only_a) + len(report.only_b) \
        + len(report.mismatched)
    worst = max((t.max_abs for t in report.tensors), default=0.0)
    lines.append(f"{'equal' if report.equal else 'differ'}: {len(report.tensors)} tensors compared, "
                 f"{differing} differ; largest abs difference {worst:.3g}")
    return "\n".join(lines)
