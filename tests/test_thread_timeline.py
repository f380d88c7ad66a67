"""tools/thread_timeline.py: a sampled per-thread timeline (a diagnosis tool for the benches)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

TIER = "default"  # docs/TESTING.md

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from thread_timeline import ThreadTimeline  # noqa: E402


def busy_reading(seconds: float) -> None:
    time.sleep(seconds)  # a blocking call: the sample shows this function, its caller


@pytest.mark.exclusive
def test_each_thread_gets_its_own_labels_and_segments():
    with ThreadTimeline(interval=0.001) as timeline:
        worker = threading.Thread(target=busy_reading, args=(0.15,), name="reader")
        worker.start()
        time.sleep(0.05)
        worker.join()
    s = timeline.summary(min_segment=0.02)
    assert s["wall_s"] >= 0.15 and s["samples"] > 20
    reader = s["threads"]["reader"]
    label, seconds = reader["top"][0]
    assert label.endswith("test_thread_timeline.py:busy_reading") and 0.08 < seconds < 0.5
    assert any(b - a >= 0.08 and label.endswith("busy_reading") for a, b, label in reader["segments"])
    main = s["threads"]["MainThread"]  # first its own sleep, then the join
    assert {lbl.rsplit(":", 1)[-1] for lbl, _ in main["top"]} >= {"test_each_thread_gets_its_own_labels_and_segments"}
    assert "timeline-sampler" not in s["threads"]
    assert "reader" in timeline.report()
