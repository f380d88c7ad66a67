"""A per-thread timeline of one operation, by sampling every thread's Python stack.

cProfile sees only the thread that enabled it and mixes nothing of the others' timing, so it
cannot say where a load spends the time its background threads overlap. This samples
`sys._current_frames()` every `interval` seconds from a thread of its own and labels each
thread's sample by the innermost zeroshard frame (the code that called into C: a `preadv`, a
hash, a copy to the GPU shows as the zeroshard function that called it). Consecutive samples
with the same label merge into one segment.

Sampling needs the GIL, so a thread that holds it for long stretches is sampled late: the
switch interval is lowered while sampling, and the figures are a diagnosis, not a benchmark.

    with ThreadTimeline() as tl:
        engine.load_checkpoint(path)
    print(tl.report())
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

OWN = str(Path(__file__).resolve().parents[1] / "zeroshard") + os.sep  # the package beside tools/


def _label(frame) -> str:
    """Innermost frame inside zeroshard, with the innermost frame of all when that is elsewhere."""
    innermost = frame
    if innermost.f_code.co_name == "_worker" and innermost.f_code.co_filename.endswith("futures/thread.py"):
        return "(idle: a pool thread waiting for work)"
    while frame is not None:
        if frame.f_code.co_filename.startswith(OWN):
            here = _short(frame)
            return here if frame is innermost else f"{here} > {_short(innermost)}"
        frame = frame.f_back
    return _short(innermost)


def _short(frame) -> str:
    path = frame.f_code.co_filename
    tail = path[len(OWN):] if path.startswith(OWN) else os.path.basename(path)
    return f"{tail}:{frame.f_code.co_name}"


class ThreadTimeline:
    def __init__(self, interval: float = 0.0005):
        self.interval = interval
        self.samples: list[tuple[float, dict[int, str]]] = []
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline-sampler", daemon=True)

    def __enter__(self) -> ThreadTimeline:
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 2)
        self.t0 = time.perf_counter()
        self._thread.start()  # waits for the sampler to run: samples before `begin` are dropped
        self.begin = time.perf_counter() - self.t0
        return self

    def __exit__(self, *exc) -> None:
        self.t1 = time.perf_counter()
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._switch)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            now = time.perf_counter() - self.t0
            frames = sys._current_frames()
            for t in threading.enumerate():
                self.names.setdefault(t.ident, t.name)
            self.samples.append((now, {tid: _label(f) for tid, f in frames.items() if tid != me}))
            time.sleep(self.interval)

    def summary(self, top: int = 8, min_segment: float = 0.002) -> dict:
        """Per thread: seconds per label (top ones) and the merged segments of at least min_segment s."""
        per_thread: dict[str, Counter] = defaultdict(Counter)
        segments: dict[str, list[list]] = defaultdict(list)
        prev_t = 0.0
        for t, labels in self.samples:
            if t < self.begin:
                continue
            t -= self.begin
            dt = t - prev_t
            prev_t = t
            for tid, label in labels.items():
                name = self.names.get(tid, str(tid))
                per_thread[name][label] += dt
                segs = segments[name]
                if segs and segs[-1][2] == label and t - segs[-1][1] <= 3 * self.interval + dt:
                    segs[-1][1] = t
                else:
                    segs.append([t - dt, t, label])
        return {
            "wall_s": round(self.t1 - self.t0 - self.begin, 4),
            "samples": len(self.samples),
            "threads": {
                name: {
                    "top": [[label, round(s, 4)] for label, s in counts.most_common(top)],
                    "segments": [[round(a, 4), round(b, 4), label] for a, b, label in segments[name]
                                 if b - a >= min_segment],
                }
                for name, counts in per_thread.items()
            },
        }

    def report(self, top: int = 8) -> str:
        s = self.summary(top)
        lines = [f"wall {s['wall_s']:.3f} s, {s['samples']} samples"]
        for name, d in s["threads"].items():
            lines.append(f"-- {name}")
            lines += [f"   {sec:7.3f} s  {label}" for label, sec in d["top"]]
            lines += [f"   [{a:6.3f} - {b:6.3f}] {label}" for a, b, label in d["segments"]]
        return "\n".join(lines)
