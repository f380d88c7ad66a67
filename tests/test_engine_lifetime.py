"""An engine the user let go of is freed, with its model, optimizer state and process groups.

Parameter hooks live where the garbage collector cannot see them; a hook holding the engine
strongly kept every engine alive for good, and with it two gloo process groups whose threads
poll every 10 ms: a process that built engines in a loop (a notebook, a test worker) slowed
down and grew by ten threads per engine. A Checkpointer (made by the first save_checkpoint) was
held for good by its atexit registration, and with it its engine and three gloo groups: 13
threads per saved engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TIER = "mixed"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import gc, os, socket, sys, tempfile, weakref
import torch, torch.distributed as dist
import zeroshard

def threads():
    return len(os.listdir("/proc/self/task"))

counts = []
for stage in (0, 1, 2, 3, 3):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()),
                                  config={"zero_optimization": {"stage": stage}})
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    if SAVE:
        engine.save_checkpoint(tempfile.mkdtemp(), async_save=stage == 3)
        engine.wait()
    alive = weakref.ref(engine)
    del engine, model
    dist.destroy_process_group()
    gc.collect()
    assert alive() is None, f"stage {stage}: the engine outlived every user reference"
    counts.append(threads())
print("threads", counts)
assert counts[-1] <= counts[0], counts
"""


@pytest.mark.slow
@pytest.mark.parametrize("save", [False, True])
def test_an_engine_let_go_is_freed_with_its_process_groups(save):
    proc = subprocess.run([sys.executable, "-c", f"SAVE = {save}\n" + SCRIPT], capture_output=True, text=True,
                          timeout=180, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "threads" in proc.stdout, proc.stdout + proc.stderr[-3000:]


FAILING_SAVE = """
import os, socket, sys, tempfile
import torch, torch.distributed as dist
import zeroshard

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.Linear(4, 1)
engine = zeroshard.initialize(model=model, optimizer=torch.optim.Adam(model.parameters()),
                              config={"zero_optimization": {"stage": 1}})
blocker = os.path.join(tempfile.mkdtemp(), "a-file")
open(blocker, "w").close()
engine.save_checkpoint(os.path.join(blocker, "run"), async_save=True)  # fails in the background
if DROP:
    engine._checkpointer = None  # nobody will call wait(): the error must still be reported
print("exiting")
"""


@pytest.mark.parametrize("drop", [False, True])
def test_a_failed_background_save_nobody_waited_for_is_reported(drop):
    proc = subprocess.run([sys.executable, "-c", f"DROP = {drop}\n" + FAILING_SAVE], capture_output=True,
                          text=True, timeout=180,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert "exiting" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "zeroshard: background checkpoint save failed" in proc.stderr, proc.stderr[-3000:]
