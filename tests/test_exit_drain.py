"""The exit-time grace period for gloo's worker threads (zeroshard/exit_drain.py) is registered
by the first collective zeroshard issues, in a fresh process (the abort it prevents is a race:
docs/ENGINE.md, "Exit"; measured 0 of 40 launches against about 1 in 5 without)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TIER = "default"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import atexit, datetime, socket, torch.distributed as dist
import zeroshard.exit_drain as drain
from zeroshard.agree import agree
assert not drain._registered
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
agree(None, action="test")
assert drain._registered
dist.destroy_process_group()
print("registered")
"""


def test_the_first_agreement_registers_the_exit_grace_period():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "registered" in proc.stdout, proc.stdout + proc.stderr
