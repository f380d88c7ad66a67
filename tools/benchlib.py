"""The harness every tools/bench_*.py shares: interleaved repeats, paired ratios, raw JSON.

A benchmark compares a side (zeroshard) with a baseline run on the same machine minutes apart, and
a shared 2-vCPU VM drifts by tens of percent over that time. So the sides run interleaved
(A B, B A, A B, ...: each repeat holds one run of every side, in rotated order), every repeat
gives one ratio A/B, and the figure reported is the MEDIAN of those paired ratios with its
inter-quartile range (IQR), never a best-of or a ratio of two independently chosen runs.

Every result file (tools/results/<bench>.json unless a path is given) holds the raw seconds of
every run, the paired ratios, and what a reader needs to judge them: the machine (cores,
memory), torch's version, the load average before and after, the cache state (warm/cold), when
the run started and the commit it ran on. `figures` lists the medians and quartiles as printed;
a document binds each figure it quotes to one key (see tests/test_docs_figures.py).

The module imports nothing heavy (no torch): benches that measure a child's peak RSS fork from
the process that imports this.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from zeroshard.errors import InvalidArgumentError  # noqa: E402  (a plain module: imports nothing heavy)

RESULTS = ROOT / "tools" / "results"
SCHEMA = 1
# When this process began its bench: every bench imports this module first, and most make their
# Report only after the runs, so a Report's own clock would record the end as the start.
STARTED = time.gmtime()


# ----------------------------------------------------------------------------- statistics (pure)

def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise InvalidArgumentError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise InvalidArgumentError(f"quantile q={q} is outside [0, 1]")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict:
    """Median, quartiles, IQR, min, max and count of `values`."""
    q1, med, q3 = quantile(values, 0.25), quantile(values, 0.5), quantile(values, 0.75)
    return {"n": len(values), "median": med, "q1": q1, "q3": q3, "iqr": q3 - q1,
            "min": min(values), "max": max(values)}


def paired_ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """One ratio per repeat: num[i] / den[i] (the two runs of repeat i ran next to each other)."""
    if len(num) != len(den):
        raise InvalidArgumentError(f"paired ratios need as many runs on each side ({len(num)} vs {len(den)})")
    if not num:
        raise InvalidArgumentError("paired ratios of no runs")
    if any(d <= 0 for d in den):
        raise InvalidArgumentError("paired ratios: a denominator run is <= 0")
    return [a / b for a, b in zip(num, den)]


def rotated(items: Sequence, rep: int) -> list:
    """`items` starting at position rep % len: over len(items) repeats each item runs once in
    each position, so no side always runs first or after the same neighbour."""
    if not items:
        return []
    k = rep % len(items)
    return list(items[k:]) + list(items[:k])


def check(value: float, target: str) -> bool:
    """Whether `value` meets `target`, written '<= 1.2' or '>= 0.8'."""
    op, bound = target.split()
    if op == "<=":
        return value <= float(bound)
    if op == ">=":
        return value >= float(bound)
    raise InvalidArgumentError(f"target {target!r}: expected '<= N' or '>= N'")


def met_in_spread(entry: dict) -> bool:
    """A target is met when its median and both quartiles meet it: a median that meets it while
    the IQR crosses it is a coin toss between runs, not a target met."""
    return all(check(entry[k], entry["target"]) for k in ("median", "q1", "q3"))


def met_label(entry: dict) -> str:
    """The table's `met` cell, from the figures themselves (so every JSON renders by one rule)."""
    if not entry.get("target"):
        return ""
    if "q1" not in entry:
        return "MET" if check(entry["value"], entry["target"]) else "NOT MET"
    if met_in_spread(entry):
        return "MET"
    return "NOT MET (IQR crosses)" if check(entry["median"], entry["target"]) else "NOT MET"


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}x"


def fmt_seconds(x: float) -> str:
    return f"{x:.3f} s" if x < 10 else f"{x:.1f} s"


def fmt_value(value: float, unit: str) -> str:
    if unit == "x":
        return fmt_ratio(value)
    return f"{value:.{0 if abs(value) >= 100 else 2}f} {unit}".strip()


def figures(data: dict) -> list[str]:
    """Every string a document may quote from one result: medians and quartiles as printed."""
    out = []
    for r in data["runs"].values():
        out += [fmt_seconds(r["median"]), fmt_seconds(r["q1"]), fmt_seconds(r["q3"])]
    for r in data["ratios"].values():
        out += [fmt_ratio(r[k]) for k in ("median", "q1", "q3")]
        out += [f"{r[k]:.1%}" for k in ("median", "q1", "q3")]
        if r.get("target"):  # a document may name the target it compares with
            bound = float(r["target"].split()[1])
            out.append(f"{bound * 100:g}%" if r.get("percent") else f"{bound:g}x")
    for v in data["values"].values():
        out.append(fmt_value(v["value"], v["unit"]))
    return sorted(set(out))


def table(data: dict) -> str:
    """The markdown table of one result (a Report's data or a result JSON read back)."""
    lines = [f"scope: {data['scope']} | cache {data['cache']} | load average before {data['load_before']}"
             + (f", after {data['load_after']}" if "load_after" in data else ""), "",
             "| measurement | median | IQR (q1 - q3) | n | target | met |", "|---|---:|---:|---:|---|---|"]
    for r in data["runs"].values():
        lines.append(f"| {r['label']} | {fmt_seconds(r['median'])} | {fmt_seconds(r['q1'])} - "
                     f"{fmt_seconds(r['q3'])} | {r['n']} | | |")
    for r in data["ratios"].values():
        met = met_label(r)
        f = (lambda x: f"{x:.1%}") if r.get("percent") else fmt_ratio
        lines.append(f"| {r['label']} (paired ratio) | {f(r['median'])} | {f(r['q1'])} - "
                     f"{f(r['q3'])} | {r['n']} | {r.get('target') or ''} | {met} |")
    for v in data["values"].values():
        met = met_label(v)
        lines.append(f"| {v['label']} | {fmt_value(v['value'], v['unit'])} | | 1 | {v.get('target') or ''} | {met} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- running

def interleave(sides: dict[str, Callable[[], float | None]], repeats: int, warmup: int = 1,
               before_each: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Run every side once per repeat, in rotated order; return each side's measured seconds.

    A side returns its own seconds (a child's wall time, a slowest-rank time) or None to be timed
    here. `warmup` repeats run first and are dropped (the first run pays imports and first-touch
    memory). `before_each(name)` runs untimed before every run (deleting the previous output).
    """
    names = list(sides)
    out: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(warmup + repeats):
        for name in rotated(names, rep):
            if before_each:
                before_each(name)
            t0 = time.perf_counter()
            got = sides[name]()
            seconds = time.perf_counter() - t0 if got is None else float(got)
            if rep >= warmup:
                out[name].append(seconds)
    return out


# What each toolkit command imports beyond zeroshard.cli (its own modules load lazily): a process
# that imports only these measures the interpreter's start-up and the command's imports.
TOOLKIT_MODULES = {"reshard": "zeroshard.toolkit.reshard zeroshard.toolkit.packed",
                   "consolidate": "zeroshard.toolkit.consolidate zeroshard.toolkit.gather",
                   "verify": "zeroshard.toolkit.verify",
                   "shard": "zeroshard.toolkit.shard zeroshard.toolkit.shard_packed"}


def start_up_command(command: str) -> list[str]:
    """A process that starts the interpreter and imports what `zeroshard COMMAND` imports, and
    does nothing else."""
    code = (f"import importlib, zeroshard.cli\nfor m in {TOOLKIT_MODULES[command].split()!r}:\n"
            f"    try: importlib.import_module(m)\n    except ModuleNotFoundError: pass")
    return [sys.executable, "-c", code]


def proc_status(key: str) -> int:
    """A byte count from /proc/self/status (e.g. VmHWM: this process's peak RSS); 0 where absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    """Cores, memory, OS, Python and torch version (read from metadata: torch is not imported)."""
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = None
    return {"cores": os.cpu_count(), "memory_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch}


def drop_caches() -> bool:
    """Drop the page cache (needs root); True only when both the sync and the drop succeeded, so
    reads that follow are cold. A caller must not record a cold row when this returns False."""
    try:
        synced = subprocess.run(["sync"], check=False).returncode == 0
    except OSError:
        return False
    if not synced:  # dirty pages that were not written back stay cached: the reads would be warm
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")  # the write happens at close, inside this try
        return True
    except OSError:
        return False


def commit() -> dict:
    """The commit this run ran on, and whether the working tree differed from it (dirty)."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    # Results and charts that earlier benches of the same session rewrote are not code: a tree that
    # differs from HEAD only there ran HEAD's code. Anything else that differs is listed.
    changed = git("diff", "--name-only", "HEAD", "--", ".", ":!tools/results", ":!docs/images")
    out = {"sha": sha, "dirty": None if changed is None else bool(changed), "how": "recorded"}
    if changed:
        out["dirty_paths"] = changed.splitlines()[:50]
    return out


# The code a bench ran is the code when it began, not when it reported: recorded at import.
STARTED_COMMIT = commit()


# ----------------------------------------------------------------------------- the report

class Report:
    """Collects one bench's runs, paired ratios and single values; writes the JSON; prints tables."""

    def __init__(self, bench: str, args: dict, scope: str, cache: str = "warm",
                 started: time.struct_time | None = None) -> None:
        """started: when the runs began (default: when this process imported benchlib)."""
        self.data: dict = {"schema": SCHEMA, "bench": bench, "args": args, "scope": scope, "cache": cache,
                           "machine": machine(), "commit": STARTED_COMMIT,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", started or STARTED),
                           "load_before": loadavg(), "runs": {}, "ratios": {}, "values": {}, "notes": []}
        now = commit()  # a bench that reports after its runs: code committed meanwhile did not run
        if now != STARTED_COMMIT:
            self.data["commit_at_report"] = now

    def runs(self, name: str, seconds: Sequence[float], label: str = "") -> dict:
        """The seconds of every measured run of one side (warm-up runs already dropped)."""
        entry = {"label": label or name, "seconds": list(seconds), **summary(seconds)}
        self.data["runs"][name] = entry
        return entry

    def ratio(self, name: str, num: str, den: str, label: str = "", target: str | None = None,
              invert: bool = False) -> dict:
        """Paired ratio of two recorded sides. invert: den/num (a speed-up, >1 is faster)."""
        a, b = self.data["runs"][num]["seconds"], self.data["runs"][den]["seconds"]
        ratios = paired_ratios(b, a) if invert else paired_ratios(a, b)
        return self.ratio_values(name, ratios, label or f"{num} / {den}", target)

    def ratio_values(self, name: str, ratios: Sequence[float], label: str, target: str | None = None,
                     percent: bool = False) -> dict:
        """A ratio whose per-repeat values were computed by the bench itself (percent: a fraction,
        printed as 12.3%)."""
        entry = {"label": label, "ratios": list(ratios), **summary(ratios), "target": target, "percent": percent}
        if target:
            entry["met"] = met_in_spread(entry)
        self.data["ratios"][name] = entry
        return entry

    def value(self, name: str, value: float, unit: str, label: str = "", target: str | None = None) -> dict:
        entry = {"label": label or name, "value": value, "unit": unit, "target": target}
        if target:
            entry["met"] = check(value, target)
        self.data["values"][name] = entry
        return entry

    def note(self, text: str) -> None:
        self.data["notes"].append(text)

    def figures(self) -> list[str]:
        return figures(self.data)

    def table(self) -> str:
        return table(self.data)

    def finish(self, path: str | os.PathLike | None = None) -> Path:
        """Record the load average after, write the JSON (default tools/results/<bench>.json)."""
        self.data["load_after"] = loadavg()
        self.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.data["figures"] = self.figures()
        out = Path(path) if path else RESULTS / f"{self.data['bench']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.data, indent=1) + "\n")
        return out
