"""Charts for docs/BENCHMARKS.md, drawn from the raw JSON the benches wrote (tools/results/*.json).

    python tools/bench_charts.py [--results tools/results] [--out docs/images] [--doc docs/BENCHMARKS.md]

One PNG per result file: every paired ratio as its median (dot) with the inter-quartile range
(bar), its target (if any) as a tick, so a reader sees the spread, not just a number. Needs
matplotlib (the `plot` extra: pip install 'zeroshard[plot]'); without it, says so and exits 1.
With --doc, also rewrites every `<!-- table bench_X -->` ... `<!-- /table -->` block of that
markdown file with the table tools/benchlib.table() prints for tools/results/bench_X.json, so the
report's tables are the JSON, never copied by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import benchlib  # noqa: E402

TABLE = re.compile(r"(<!-- table (bench_\w+) -->\n).*?(<!-- /table -->)", re.S)
TARGETS = re.compile(r"(<!-- targets -->\n).*?(<!-- /targets -->)", re.S)


def update_doc(doc: Path, results: Path) -> int:
    """Refill the doc's table blocks from the JSON; returns how many were filled."""
    filled = 0

    def fill(m: re.Match) -> str:
        nonlocal filled
        path = results / f"{m.group(2)}.json"
        if not path.exists():
            return m.group(0)
        filled += 1
        data = json.loads(path.read_text())
        notes = "".join(f"\n{n}\n" for n in data.get("notes", []))
        return f"{m.group(1)}{benchlib.table(data)}\n{notes}{m.group(3)}"

    text = TABLE.sub(fill, doc.read_text())
    text = TARGETS.sub(lambda m: f"{m.group(1)}{targets(results)}\n{m.group(2)}", text)
    doc.write_text(text)
    return filled


def harness_results(results: Path) -> list[tuple[Path, dict]]:
    """The result files tools/benchlib.py wrote (others, such as bench_recovery's raw timings, have
    no paired ratios to draw)."""
    found = []
    for path in sorted(results.glob("bench_*.json")):
        data = json.loads(path.read_text())
        if data.get("schema") == benchlib.SCHEMA:
            found.append((path, data))
    return found


def targets(results: Path) -> str:
    """One row per figure that has a target, over every result file."""
    rows = ["| bench | figure | median | IQR | target | result |", "|---|---|---:|---:|---|---|"]
    for path, data in harness_results(results):
        for r in data["ratios"].values():
            if r.get("target"):
                f = (lambda x: f"{x:.1%}") if r.get("percent") else benchlib.fmt_ratio
                rows.append(f"| {path.stem} | {r['label']} | {f(r['median'])} | {f(r['q1'])} - {f(r['q3'])} | "
                            f"{r['target']} | {result(r)} |")
        for v in data["values"].values():
            if v.get("target"):
                rows.append(f"| {path.stem} | {v['label']} | {benchlib.fmt_value(v['value'], v['unit'])} | - | "
                            f"{v['target']} | {result(v)} |")
    return "\n".join(rows)


def result(entry: dict) -> str:
    """met, or why not, by the rule every table follows (benchlib.met_label: median and IQR)."""
    label = benchlib.met_label(entry)
    return "met" if label == "MET" else f"**{label}**"


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
            ax.plot([float(bound)], [y], "|", color="tab:green" if benchlib.met_label(r) == "MET" else "tab:red",
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
    p.add_argument("--doc", default=None, help="refill this markdown file's <!-- table bench_X --> blocks")
    args = p.parse_args(argv)
    if args.doc:
        print(f"{args.doc}: {update_doc(Path(args.doc), Path(args.results))} table(s) filled")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench_charts: matplotlib is not installed (pip install 'zeroshard[plot]')", file=sys.stderr)
        return 1
    for path, data in harness_results(Path(args.results)):
        out = Path(args.out) / f"{path.stem}.png"
        if chart(data, out):
            print(f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
