"""Every benchmark figure the docs quote is bound to ONE key of ONE result JSON.

A figure (0.37x, 18.5%, 0.121 s, 1634 MiB, 1.49 GB) in README.md's Performance section or in
docs/BENCHMARKS.md is followed, in the same paragraph, by a marker naming its source:

    tuned DCP takes 1.54x (1.50x-1.66x)<!-- tools/results/bench_checkpoint.json:ratios.save_vs_dcp -->

A marker binds the figures written since the previous marker (or the paragraph's start). Each must
be that entry's median or a quartile as tools/benchlib.py prints it (a ratio or a run), its value
(a single value), its target's bound (`...:ratios.x.target`), or, in a JSON the harness did not
write, the number at that key. A key naming a minimum, maximum or best-of is refused: such a
figure is never quoted. Ratios written in words ("twice", "four times", "a seventh of") are
refused: write the figure and bind it. The `<!-- table bench_X -->` and `<!-- targets -->`
blocks of docs/BENCHMARKS.md must be exactly what tools/bench_charts.py prints from the JSON
(each row is one key). Every JSON a doc binds names the commit its run ran on.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

TIER = "default"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_charts  # noqa: E402
import benchlib  # noqa: E402

FIGURE = re.compile(r"(?<![\w.,/])\d[\d,]*(?:\.\d+)?(?:x\b|%|(?: (?:s|ms|kB|MB|GB|MiB|GiB)\b))")
MARKER = re.compile(r"<!-- (tools/results/[\w/]+\.json):([\w.@-]+) -->")  # @: a swept size (zs1@5M)
WORDS = re.compile(r"\b(?:twice|thrice|half as|(?:two|three|four|five|six|seven|eight|nine|ten|a hundred) times"
                   r"|a (?:third|quarter|fifth|sixth|seventh|eighth|ninth|tenth) of|an order of magnitude)\b", re.I)
# (torch's cuda max_allocated is the peak within one run, the quantity measured, not a best of runs)
BEST_OF = re.compile(r"(?:^|[._])(?:min|max(?!_allocated)|best|fastest|lowest)(?:$|[._])")
BLOCK = re.compile(r"<!-- (table (bench_\w+)|targets) -->\n.*?<!-- /(?:table|targets) -->\n?", re.S)
CODE = re.compile(r"^```.*?^```|^    .*?$|`[^`\n]*`", re.S | re.M)
BYTES = {"kB": 1e3, "MB": 1e6, "GB": 1e9, "MiB": 2**20, "GiB": 2**30}

# Result files written before the harness recorded a run's commit and start (their commit was
# inferred afterwards: the last commit before the run): the GPU runs, which no session since has had
# a GPU to repeat. Every other file a doc binds records both; a rerun takes a file off this list.
INFERRED_PROVENANCE = {
    "tools/results/gpu/bench_checkpoint_h100_timeline.json",
    "tools/results/gpu/bench_checkpoint_h100_write_behind_fixed_1.json",
    "tools/results/gpu/bench_checkpoint_h100_write_behind_fixed_2.json",
    "tools/results/gpu/bench_checkpoint_h100_write_inline.json",
    "tools/results/gpu/bench_checkpoint_h200_dcp.json",
    "tools/results/gpu/bench_checkpoint_h200_hash_behind_1.json",
    "tools/results/gpu/bench_checkpoint_h200_hash_behind_2.json",
    "tools/results/gpu/bench_checkpoint_h200_hash_inline.json",
    "tools/results/gpu/bench_checkpoint_pinned_stage1.json",
    "tools/results/gpu/bench_checkpoint_pinned_stage3.json",
    "tools/results/gpu/bench_checkpoint_previous_stage3.json",
    "tools/results/gpu/bench_checkpoint.json",
    "tools/results/gpu/bench_train_bf16.json",
    "tools/results/gpu/bench_train_bf16_b32.json",
}


def number(fig: str) -> tuple[float, int, str]:
    """A figure's number, its decimals and its unit: '1,246 MiB' -> (1246.0, 0, 'MiB')."""
    m = re.match(r"([\d,]+(?:\.(\d+))?)\s*(.*)", fig)
    return float(m.group(1).replace(",", "")), len(m.group(2) or ""), m.group(3)


def lookup(data: dict, key: str):
    node = data
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def quotable(data: dict, key: str) -> tuple[set[str], float | None]:
    """The strings a doc may write for `key` (an entry's median and quartiles, or its value, or
    its target's bound), and for a plain number the number itself."""
    if key.endswith(".target"):
        entry = lookup(data, key[: -len(".target")])
        if not isinstance(entry, dict) or not entry.get("target"):
            return set(), None
        bound = float(entry["target"].split()[1])
        if entry.get("percent"):
            return {f"{bound * 100:g}%"}, None
        unit = entry.get("unit", "x")
        return {f"{bound:g}x" if unit == "x" else f"{bound:g} {unit}"}, None
    entry = lookup(data, key)
    if isinstance(entry, dict) and "ratios" in entry:
        f = (lambda x: f"{x:.1%}") if entry.get("percent") else benchlib.fmt_ratio
        return {f(entry[k]) for k in ("median", "q1", "q3")}, None
    if isinstance(entry, dict) and "seconds" in entry:
        return {benchlib.fmt_seconds(entry[k]) for k in ("median", "q1", "q3")}, None
    if isinstance(entry, dict) and "value" in entry:
        return {benchlib.fmt_value(entry["value"], entry["unit"])}, None
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        return set(), float(entry)
    return set(), None


def matches(fig: str, allowed: set[str], leaf: float | None, key: str) -> bool:
    if fig.replace(",", "") in allowed:
        return True
    if leaf is None:
        return False
    value, decimals, unit = number(fig)
    if unit in BYTES and re.search(r"bytes|allocated", key.lower()):  # a byte count, written in MiB/GB
        leaf = leaf / BYTES[unit]
    return round(leaf, decimals) == value


def prose(text: str) -> str:
    """The text a reader reads as claims: without code, and with generated blocks blanked."""
    return CODE.sub(" ", BLOCK.sub("\n\n", text))


def problems(text: str, root: Path = ROOT) -> list[str]:
    """What is wrong with the figures of `text`: unbound, not the key's, from a best-of, in words."""
    out = [f"in words: {m.group(0)!r}" for m in WORDS.finditer(prose(text))]
    for para in re.split(r"\n\s*\n", prose(text)):
        at = 0
        for m in MARKER.finditer(para):
            figs = FIGURE.findall(para[at:m.start()])
            at = m.end()
            source = f"{m.group(1)}:{m.group(2)}"
            path = root / m.group(1)
            if BEST_OF.search(m.group(2)):
                out.append(f"{source}: a minimum, maximum or best-of is never quoted")
                continue
            if not path.exists():
                out.append(f"{source}: no such file")
                continue
            data = json.loads(path.read_text())
            if not (data.get("commit") or {}).get("sha"):
                out.append(f"{m.group(1)}: names no commit")
            allowed, leaf = quotable(data, m.group(2))
            if not allowed and leaf is None:
                out.append(f"{source}: no such entry or number")
            elif not figs:
                out.append(f"{source}: binds no figure")
            out += [f"{fig} is not {source}" for fig in figs
                    if (allowed or leaf is not None) and not matches(fig, allowed, leaf, m.group(2))]
        out += [f"{fig} is bound to no JSON key (…{para[max(0, at - 40):at + 40]!r}…)"
                for fig in FIGURE.findall(para[at:])]
    return out


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every section of a markdown file."""
    parts = re.split(r"(?m)^(#{1,4} .*)$", text)
    return [("", parts[0])] + list(zip(parts[1::2], parts[2::2]))


def provenance(path: str, root: Path = ROOT) -> str | None:
    """What is wrong with the record of when and on what a bound result file ran, or None."""
    data = json.loads((root / path).read_text())
    commit = data.get("commit") or {}
    if path in INFERRED_PROVENANCE:
        return None if str(commit.get("how", "")).startswith("inferred") else f"{path}: rerun; off INFERRED_PROVENANCE"
    if commit.get("how") != "recorded":
        return f"{path}: its commit was not recorded by the run ({commit.get('how')!r})"
    if not data.get("started") or data.get("started") == data.get("finished"):
        return f"{path}: no start recorded apart from its end"
    return None


def readme_performance() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"(?ms)^### Performance\n(.*?)(?=^## )", text)
    assert m, "README.md has no '### Performance' section"
    return m.group(1)


def test_readme_performance_binds_every_figure_to_one_json_key():
    text = readme_performance()
    assert len(MARKER.findall(text)) >= 20, "the Performance section binds too few figures to check anything"
    assert problems(text) == []


def test_benchmarks_md_prose_binds_every_figure():
    doc = sections((ROOT / "docs" / "BENCHMARKS.md").read_text())
    assert sum(len(MARKER.findall(b)) for _, b in doc) >= 20
    assert [f"{h}: {p}" for h, body in doc for p in problems(body)] == []


def test_every_bound_result_recorded_its_commit_and_start():
    texts = [(ROOT / "README.md").read_text(), (ROOT / "docs" / "BENCHMARKS.md").read_text()]
    bound = sorted({m.group(1) for text in texts for m in MARKER.finditer(text)})
    assert len(bound) >= 10
    assert [p for p in map(provenance, bound) if p] == []
    assert sorted(INFERRED_PROVENANCE - set(bound)) == [], "a listed file is no longer bound: take it off"


def test_benchmarks_md_tables_are_the_json():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    results = ROOT / "tools" / "results"
    blocks = list(BLOCK.finditer(text))
    assert len(blocks) >= 10
    for m in blocks:
        if m.group(2):
            data = json.loads((results / f"{m.group(2)}.json").read_text())
            notes = "".join(f"\n{n}\n" for n in data.get("notes", []))
            want = f"<!-- table {m.group(2)} -->\n{benchlib.table(data)}\n{notes}<!-- /table -->"
        else:
            want = f"<!-- targets -->\n{bench_charts.targets(results)}\n<!-- /targets -->"
        assert m.group(0).rstrip("\n") == want, f"{m.group(1)}: rerun tools/bench_charts.py --doc"


def command_problems(args: dict, command: str) -> list[str]:
    """How a printed `python tools/bench_X.py ...` command differs from the args its run recorded:
    each flag printed must be an argument of the run, holding the value the run had. Not checked:
    where the result was written (--json, an output path, not a condition of the measurement), a
    value with a shell variable in it ($1), and flags the run set that the command leaves out
    (the run's defaults are not in its JSON)."""
    tokens = shlex.split(command.replace("\\\n", " ").split(" #")[0].split(";")[0])
    tokens = tokens[next(i for i, t in enumerate(tokens) if t.startswith("tools/bench_")) + 1:]
    out, printed, i = [], {}, 0
    while i < len(tokens):
        token, has_value = tokens[i], i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
        if token.startswith("--"):  # a flag, with the value after it or alone (True)
            printed[token[2:].replace("-", "_")] = tokens[i + 1] if has_value else True
            i += 2 if has_value else 1
            continue
        if token not in {str(v) for v in args.values()}:  # a positional argument
            out.append(f"{token}: no argument of the run has this value")
        i += 1
    printed.pop("json", None)
    for key, value in printed.items():
        if key not in args:
            out.append(f"--{key}: the run had no such argument")
        elif isinstance(value, str) and "$" in value:
            continue
        elif value is True:
            if args[key] is not True:
                out.append(f"--{key}: the run had {args[key]!r}")
        elif str(args[key]) != value and not _same_number(args[key], value):
            out.append(f"--{key} {value}: the run had {args[key]!r}")
    return out


def _same_number(a, b: str) -> bool:
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def test_every_table_has_the_command_its_run_ran_beside_it():
    """Each `<!-- table bench_X -->` block of docs/BENCHMARKS.md follows, in its section, a printed
    command of its bench whose flags are the run's (the section may print several: one fits); a
    result kept under another name than the bench's own is named by that command's --json."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    results = ROOT / "tools" / "results"
    checked, out = 0, []
    for heading, body in sections(text):
        for m in BLOCK.finditer(body):
            if not m.group(2):
                continue
            data = json.loads((results / f"{m.group(2)}.json").read_text())
            commands = re.findall(rf"(?m)^ {{4}}.*tools/{data['bench']}\.py(?:.*\\\n)*.*$", body[:m.start()])
            if m.group(2) != data["bench"]:  # not the bench's default file: a rerun must be told where
                commands = [c for c in commands if re.search(rf"--json \S*(?:{m.group(2)}|\$\w*)\.json", c)]
            verdicts = [command_problems(data["args"], c) for c in commands]
            if not commands or all(verdicts):
                out.append(f"{heading} / {m.group(2)}: " + ("no command printed" if not commands else
                                                            "; ".join(min(verdicts, key=len))))
            checked += 1
    assert checked >= 10
    assert out == []


def test_command_check_catches_a_flag_the_run_did_not_have():
    args = {"repeat": 3, "json": None, "profile": False, "dim": 1024}
    assert command_problems(args, "    python tools/bench_x.py --repeat 3   # note --dim 5") == []
    assert command_problems(args, "    python tools/bench_x.py --repeat 5") == ["--repeat 5: the run had 3"]
    assert command_problems(args, "    python tools/bench_x.py --profile") == ["--profile: the run had False"]
    assert command_problems(args, "    python tools/bench_x.py --layers 4") == [
        "--layers: the run had no such argument"]
    assert command_problems({**args, "json": "/tmp/x.json"}, "    python tools/bench_x.py --json y.json") == []
    assert command_problems({**args, "what": "both"}, "    python tools/bench_x.py both --repeat 3") == []
    assert command_problems({**args, "what": "both"}, "    python tools/bench_x.py memory") == [
        "memory: no argument of the run has this value"]


def _demo(tmp_path: Path, commit: bool = True) -> Path:
    rep = benchlib.Report("bench_demo", {}, scope="test")
    rep.runs("a", [1.0, 1.0, 1.0])
    rep.runs("b", [2.0, 2.0, 4.0])
    rep.ratio("a_vs_b", "a", "b", target="<= 0.6")  # ratios 0.5 0.5 0.25: median 0.50x, q1 0.38x
    rep.value("start_up_min_s", 0.25, "s")
    out = rep.finish(tmp_path / "tools" / "results" / "bench_demo.json")
    if not commit:
        data = json.loads(out.read_text())
        del data["commit"]
        out.write_text(json.dumps(data))
    return tmp_path


KEY = "<!-- tools/results/bench_demo.json:ratios.a_vs_b -->"


def test_checker_accepts_a_median_and_quartiles_bound_to_their_key(tmp_path):
    root = _demo(tmp_path)
    assert problems(f"it takes 0.50x (0.38x-0.50x){KEY}, under 0.6x"
                    "<!-- tools/results/bench_demo.json:ratios.a_vs_b.target -->.", root) == []


@pytest.mark.parametrize("text,want", [
    ("it takes 0.25x" + KEY, "0.25x is not"),  # the minimum ratio: a best-of, not a quartile
    ("it takes 0.50x and 1.0 s" + KEY, "1.0 s is not"),  # a figure the key does not hold
    ("it takes 0.50x", "bound to no JSON key"),  # no marker after it
    ("it takes 0.50x" + KEY + " and 0.38x.", "bound to no JSON key"),  # after the last marker
    ("0.50x\n\nand in the next paragraph" + KEY, "binds no figure"),  # a marker binds its paragraph
    ("0.25 s<!-- tools/results/bench_demo.json:values.start_up_min_s -->", "best-of is never quoted"),
    ("0.25x<!-- tools/results/bench_demo.json:ratios.a_vs_b.min -->", "best-of is never quoted"),
    ("it takes four times as long", "in words"),
    ("DCP took twice our time", "in words"),
    ("about a seventh of a sync save", "in words"),
    ("0.50x<!-- tools/results/bench_other.json:ratios.a_vs_b -->", "no such file"),
])
def test_checker_catches(tmp_path, text, want):
    root = _demo(tmp_path)
    found = problems(text, root)
    assert any(want in p for p in found), found


def test_checker_refuses_a_json_that_names_no_commit(tmp_path):
    root = _demo(tmp_path, commit=False)
    assert problems("0.50x" + KEY, root) == ["tools/results/bench_demo.json: names no commit"]


def test_provenance_refuses_an_inferred_commit_and_a_start_that_is_its_end(tmp_path):
    root, path = _demo(tmp_path), "tools/results/bench_demo.json"
    data = json.loads((root / path).read_text())

    def check(**change) -> str | None:
        for key, value in change.items():
            if key == "how":
                data["commit"]["how"] = value
            else:
                data[key] = value
        (root / path).write_text(json.dumps(data))
        return provenance(path, root)

    assert check(started="2026-12-02T01:00:00Z", finished="2026-12-02T01:05:00Z") is None
    assert "not recorded" in check(how="inferred after the run: the last commit on main before its start")
    assert "no start" in check(how="recorded", started="2026-12-02T01:05:00Z")


def test_checker_reads_plain_numbers_and_bytes_from_other_json(tmp_path):
    path = tmp_path / "tools" / "results" / "raw.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"commit": {"sha": "abc"}, "bytes": {"zs": 1486784329}, "steps": [{"ms": 61.96}]}))
    assert problems("1.49 GB<!-- tools/results/raw.json:bytes.zs --> and 62.0 ms"
                    "<!-- tools/results/raw.json:steps.0.ms -->", tmp_path) == []
    assert problems("1.50 GB<!-- tools/results/raw.json:bytes.zs -->", tmp_path) != []


def test_a_peak_within_one_run_is_quoted_and_a_maximum_over_runs_is_not(tmp_path):
    path = tmp_path / "tools" / "results" / "raw.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"commit": {"sha": "abc"}, "cuda_max_allocated": 4514545152, "step_max": 1.0}))
    assert problems("4305 MiB<!-- tools/results/raw.json:cuda_max_allocated -->", tmp_path) == []
    assert problems("1.0 s<!-- tools/results/raw.json:step_max -->", tmp_path) == [
        "tools/results/raw.json:step_max: a minimum, maximum or best-of is never quoted"]


@pytest.mark.parametrize("bench", ["bench_checkpoint", "bench_scale", "bench_toolkit"])
def test_committed_results_record_what_a_reader_needs(bench):
    data = json.loads((ROOT / "tools" / "results" / f"{bench}.json").read_text())
    assert data["machine"]["cores"] and data["machine"]["memory_bytes"] and data["machine"]["torch"]
    assert len(data["load_before"]) == 3 and len(data["load_after"]) == 3 and data["cache"]
    assert data["commit"]["sha"] and data["commit"]["how"]
    for r in data["ratios"].values():
        assert len(r["ratios"]) == r["n"] >= 2
        assert r["median"] == pytest.approx(benchlib.quantile(r["ratios"], 0.5))
