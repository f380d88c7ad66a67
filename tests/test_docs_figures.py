"""Every benchmark figure the README quotes is a median (or quartile) in the latest result JSON.

The README's benchmark bullets each name their bench (`tools/bench_X.py`, or a result file
`tools/results/bench_X_Y.json` of another run of it); every figure in a bullet
(0.37x, 18.5%, 0.121 s, 1634 MiB) must be one of the strings tools/benchlib.figures() derives from
tools/results/bench_X.json, so a quoted number cannot drift from the run it came from, nor be a
best-of. tools/results/README_figures.md holds the bullets proposed for the README with the
latest JSON; the README itself is checked the same way.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import benchlib  # noqa: E402

FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:x|%| s\b| MiB\b)")
BENCH = re.compile(r"tools/(?:results/)?(bench_\w+)\.(?:py|json)")  # a bench, or one of its result files


def bullets(text: str) -> list[str]:
    """The benchmark bullets: from the line that introduces the benches to the next heading."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Benchmarks under `tools/`")), None)
    if start is None:
        return []
    out: list[str] = []
    for ln in lines[start + 1:]:
        if ln.startswith("#"):
            break
        if ln.startswith("- "):
            out.append(ln)
        elif out and ln.startswith("  "):
            out[-1] += " " + ln.strip()
    return out


def unbacked(text: str, results: Path) -> list[str]:
    """Figures in the bullets of `text` that their bench's JSON does not hold."""
    missing = []
    for bullet in bullets(text):
        benches = BENCH.findall(bullet)
        known: set[str] = set()
        for bench in benches:
            path = results / f"{bench}.json"
            if path.exists():
                known |= set(benchlib.figures(json.loads(path.read_text())))
        for fig in FIGURE.findall(bullet):
            if fig not in known:
                missing.append(f"{fig} ({', '.join(benches) or 'no bench named'})")
    return missing


def count(text: str) -> int:
    return sum(len(FIGURE.findall(b)) for b in bullets(text))


def test_proposed_readme_lines_quote_only_json_figures():
    text = (ROOT / "tools" / "results" / "README_figures.md").read_text()
    assert count(text) >= 8, "the proposed README bullets quote too few figures to check anything"
    assert unbacked(text, ROOT / "tools" / "results") == []


def test_readme_quotes_only_json_figures():
    text = (ROOT / "README.md").read_text()
    assert bullets(text), "README.md has no benchmark bullets after 'Benchmarks under `tools/`'"
    assert unbacked(text, ROOT / "tools" / "results") == []


def test_checker_catches_a_figure_not_in_the_json(tmp_path):
    rep = benchlib.Report("bench_demo", {}, scope="test")
    rep.runs("a", [1.0, 1.0, 1.0])
    rep.runs("b", [2.0, 2.0, 4.0])
    rep.ratio("a_vs_b", "a", "b")  # ratios 0.5 0.5 0.25: median 0.50x, q1 0.38x
    rep.finish(tmp_path / "bench_demo.json")
    intro = "Benchmarks under `tools/`, each measured:\n\n"
    assert unbacked(intro + "- `tools/bench_demo.py`: 0.50x (IQR 0.38x-0.50x)\n", tmp_path) == []
    # a best-of (0.25x is the min, not a median or quartile) and a made-up figure are both caught
    assert unbacked(intro + "- `tools/bench_demo.py`: 0.25x, 3.25x\n  and 1.0 s\n", tmp_path) == [
        "0.25x (bench_demo)", "3.25x (bench_demo)", "1.0 s (bench_demo)"]
    # a figure in a bullet that names no bench has nothing to back it
    assert unbacked(intro + "- a claim of 2.41x\n", tmp_path) == ["2.41x (no bench named)"]


@pytest.mark.parametrize("bench", ["bench_checkpoint", "bench_scale", "bench_toolkit"])
def test_committed_results_record_what_a_reader_needs(bench):
    data = json.loads((ROOT / "tools" / "results" / f"{bench}.json").read_text())
    assert data["machine"]["cores"] and data["machine"]["memory_bytes"] and data["machine"]["torch"]
    assert len(data["load_before"]) == 3 and len(data["load_after"]) == 3 and data["cache"]
    for r in data["ratios"].values():
        assert len(r["ratios"]) == r["n"] >= 2
        assert r["median"] == pytest.approx(benchlib.quantile(r["ratios"], 0.5))
