"""The benchmark harness's statistics (tools/benchlib.py): pure, no processes, no timing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TIER = "default"  # docs/TESTING.md

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import benchlib  # noqa: E402

from zeroshard.errors import ZeroshardError  # noqa: E402


def test_quantile_interpolates_like_numpy():
    xs = [7.0, 1.0, 3.0, 5.0]  # sorted 1 3 5 7
    assert benchlib.quantile(xs, 0.5) == 4.0
    assert benchlib.quantile(xs, 0.25) == 2.5
    assert benchlib.quantile(xs, 0.75) == 5.5
    assert benchlib.quantile(xs, 0.0) == 1.0 and benchlib.quantile(xs, 1.0) == 7.0
    assert benchlib.quantile([2.0], 0.75) == 2.0


def test_summary_median_and_iqr_of_odd_count():
    s = benchlib.summary([5, 1, 4, 2, 3])
    assert (s["median"], s["q1"], s["q3"], s["iqr"], s["n"], s["min"], s["max"]) == (3, 2, 4, 2, 5, 1, 5)


def test_ratios_are_paired_per_repeat_not_best_over_best():
    # the machine slowed down in repeats 3-4: both sides slow, the ratio per repeat stays 0.5
    ours, base = [1.0, 1.1, 3.0, 3.2], [2.0, 2.2, 6.0, 6.4]
    ratios = benchlib.paired_ratios(ours, base)
    assert ratios == pytest.approx([0.5] * 4)
    # best/best would have mixed two different repeats and claimed something else
    assert min(ours) / min([6.0, 2.2, 6.4, 2.5]) != pytest.approx(benchlib.summary(
        benchlib.paired_ratios(ours, [6.0, 2.2, 6.4, 2.5]))["median"])


def test_paired_ratio_median_is_robust_to_one_outlier():
    ratios = benchlib.paired_ratios([1, 1, 1, 1, 9], [1, 1, 1, 1, 1])
    assert benchlib.summary(ratios)["median"] == 1.0
    assert benchlib.summary(ratios)["max"] == 9.0


@pytest.mark.parametrize("num,den", [([1.0, 2.0], [1.0]), ([], []), ([1.0], [0.0])])
def test_paired_ratios_reject_unpaired_or_empty_or_zero(num, den):
    with pytest.raises(ZeroshardError):
        benchlib.paired_ratios(num, den)


def test_quantile_rejects_empty_and_bad_q():
    with pytest.raises(ZeroshardError):
        benchlib.quantile([], 0.5)
    with pytest.raises(ZeroshardError):
        benchlib.quantile([1.0], 1.5)


def test_rotation_puts_each_side_in_each_position():
    seen = [benchlib.rotated("ABC", r) for r in range(3)]
    assert seen == [list("ABC"), list("BCA"), list("CAB")]
    assert {tuple(p[0] for p in seen)} == {("A", "B", "C")}


def test_interleave_alternates_sides_and_drops_warmup():
    order = []
    clock = iter(range(100))
    sides = {"A": lambda: order.append("A") or float(next(clock)), "B": lambda: order.append("B") or None}
    out = benchlib.interleave(sides, repeats=4, warmup=1)
    assert order == list("ABBAABBAAB")  # A B | B A | A B | B A | A B
    assert len(out["A"]) == 4 and len(out["B"]) == 4
    assert out["A"] == [1.0, 2.0, 3.0, 4.0]  # the warm-up's 0.0 dropped


def test_check_targets():
    assert benchlib.check(1.2, "<= 1.2") and not benchlib.check(1.21, "<= 1.2")
    assert benchlib.check(0.8, ">= 0.8") and not benchlib.check(0.79, ">= 0.8")
    with pytest.raises(ZeroshardError):
        benchlib.check(1.0, "< 1")


def test_report_json_holds_runs_ratios_machine_load_and_figures(tmp_path):
    rep = benchlib.Report("demo", {"size": 1}, scope="CPU, test", cache="warm")
    rep.runs("ours", [1.0, 2.0, 3.0])
    rep.runs("base", [2.0, 2.0, 2.0])
    r = rep.ratio("ours_vs_base", "ours", "base", target="<= 1.2")
    # the median meets 1.2, the upper quartile does not: not a target met, and the table says why
    assert r["ratios"] == [0.5, 1.0, 1.5] and r["median"] == 1.0 and r["q3"] > 1.2 and r["met"] is False
    assert benchlib.met_label(r) == "NOT MET (IQR crosses)"
    wide = rep.ratio("ours_vs_base_wide", "ours", "base", target="<= 2")
    assert wide["met"] is True and benchlib.met_label(wide) == "MET"
    s = rep.ratio("speedup", "ours", "base", invert=True, target=">= 1.5")
    assert s["median"] == 1.0 and s["met"] is False and benchlib.met_label(s) == "NOT MET"
    rep.value("rss", 123.4, "MiB")
    out = rep.finish(tmp_path / "demo.json")
    data = json.loads(out.read_text())
    assert data["machine"]["cores"] >= 1 and data["machine"]["memory_bytes"] > 0
    assert len(data["load_before"]) == 3 and len(data["load_after"]) == 3
    assert data["cache"] == "warm" and data["runs"]["ours"]["seconds"] == [1.0, 2.0, 3.0]
    assert {"1.00x", "0.75x", "1.25x", "100.0%", "123 MiB", "2.000 s", "1.2x", "1.5x"} <= set(data["figures"])
    assert "0.50x" not in data["figures"]  # the lowest ratio, neither median nor quartile
    assert "NOT MET" in rep.table() and "| 1.00x |" in rep.table()


def test_a_report_names_the_commit_its_runs_began_on(monkeypatch):
    """A bench that commits (or whose tree is edited) while it runs reports the code it began with,
    and says the tree moved before the report."""
    monkeypatch.setattr(benchlib, "STARTED_COMMIT", {"sha": "a" * 40, "dirty": False, "how": "recorded"})
    monkeypatch.setattr(benchlib, "commit", lambda: {"sha": "b" * 40, "dirty": False, "how": "recorded"})
    data = benchlib.Report("demo", {}, scope="CPU, test").data
    assert data["commit"]["sha"] == "a" * 40 and data["commit_at_report"]["sha"] == "b" * 40
    monkeypatch.setattr(benchlib, "commit", lambda: benchlib.STARTED_COMMIT)
    assert "commit_at_report" not in benchlib.Report("demo", {}, scope="CPU, test").data
