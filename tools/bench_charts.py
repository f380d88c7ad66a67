"""Charts for docs/BENCHMARKS.md, drawn from the raw JSON the benches wrote (tools/results/*.json).

    python tools/bench_charts.py [--results tools/results] [--out docs/images]

One PNG per result file: every paired ratio as its median (dot) with the inter-quartile range
(bar), its target (if any) as a tick, so a reader sees the spread, not just a number. Needs
matplotlib (the `plot` extra: pip install 'zeroshard[plot]'); without it, says so and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chart(data: dict, out: Path) -> bool:
    """Draw one bench's ratios; False when it has none."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    ratios = [r for r in data["ratios"].values() if not r.get("percent")]
    percents = [r for r in data["ratios"].values() if r.get("percent")]
    if not ratios and not percents:
        return False
    rows = ratios + percents
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.8), dpi=80)
    for y, r in enumerate(rows):
        ax.plot([r["q1"], r["q3"]], [y, y], color="tab:blue", lw=5, alpha=0.5, solid_capstyle="butt")
        ax.plot([r["median"]], [y], "o", color="tab:blue")
        if r.get("target"):
            op, bound = r["target"].split()
            ax.plot([float(bound)], [y], "|", color="tab:red" if not r.get("met") else "tab:green",
                     markersize=16, mew=2)
        ax.annotate(f"{r['median']:.1%}" if r.get("percent") else f"{r['median']:.2f}x", (r["median"], y),
                    textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["label"][:70] for r in rows], fontsize=8)
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("paired ratio: median (dot), IQR (bar), target (tick: green met, red missed); log scale",
                  fontsize=8)
    scope = textwrap.fill(f"{data['bench']}: {data['scope']}", 150)
    fig.suptitle(f"{scope}\nload average {data['load_before']} -> {data.get('load_after')}, n = {rows[0]['n']} "
                 f"repeats, {data['started']}", fontsize=7, x=0.01, ha="left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(ROOT / "tools" / "results"))
    p.add_argument("--out", default=str(ROOT / "docs" / "images"))
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench_charts: matplotlib is not installed (pip install 'zeroshard[plot]')", file=sys.stderr)
        return 1
    for path in sorted(Path(args.results).glob("bench_*.json")):
        data = json.loads(path.read_text())
        out = Path(args.out) / f"{path.stem}.png"
        if chart(data, out):
            print(f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
