"""Workers of the right kind: threads for big files (their work releases the GIL), spawned
processes for many small ones; either way the same bytes, and a failure leaves nothing."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_scale import leftovers

from zeroshard.errors import CheckpointError
from zeroshard.toolkit import gather, transfer, workers
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.shard import shard
from zeroshard.toolkit.verify import verify

from checkpoints import read_checkpoint
from test_bad_input import flip_byte_in
from test_roundtrip import assert_same

TIER = "default"  # docs/TESTING.md


def test_pool_kind_follows_file_size():
    with workers.worker_pool(2, [workers.BIG_FILE_BYTES] * 3) as pool:
        assert type(pool).__name__ == "ThreadPoolExecutor"
    with workers.worker_pool(2, [workers.BIG_FILE_BYTES, 1000]) as pool:
        assert type(pool).__name__ == "ProcessPoolExecutor"


@pytest.fixture
def big_files(monkeypatch):
    """Every file counts as big (threads) and goes through the windowed copy; records the pools."""
    monkeypatch.setattr(workers, "BIG_FILE_BYTES", 1)
    monkeypatch.setattr(gather, "WHOLE_HASH_BYTES", 0)  # no input is read whole
    monkeypatch.setattr(transfer, "WINDOW_BYTES", 4096)
    monkeypatch.setattr(transfer, "STEP_BYTES", 1024)
    kinds = []
    original = workers.worker_pool

    def spy(count, sizes):
        pool = original(count, sizes)
        kinds.append(type(pool).__name__)
        return pool

    monkeypatch.setattr(transfer, "worker_pool", spy)
    monkeypatch.setattr(workers, "worker_pool", spy)
    return kinds


@pytest.fixture
def model(tmp_path):
    g = torch.Generator().manual_seed(11)
    tensors = {f"t{i}": torch.randn(700 + 131 * i, generator=g) for i in range(12)}
    tensors["half"] = torch.randn(999, generator=g).half()
    save_file(tensors, str(tmp_path / "m.safetensors"))
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "w4"), 4)
    return tensors


def test_thread_workers_give_the_same_bytes(tmp_path, model, big_files):
    for to in (3, 8):
        reshard(str(tmp_path / "w4"), to, str(tmp_path / f"one{to}"))
        reshard(str(tmp_path / "w4"), to, str(tmp_path / f"two{to}"), workers=2)
        assert verify(str(tmp_path / f"two{to}"), workers=2, deep=True).ok
        assert_same(read_checkpoint(str(tmp_path / f"one{to}")), read_checkpoint(str(tmp_path / f"two{to}")))
    consolidate(str(tmp_path / "w4"), str(tmp_path / "a.safetensors"))
    consolidate(str(tmp_path / "w4"), str(tmp_path / "b.safetensors"), workers=2)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert_same(model, load_file(tmp_path / "b.safetensors"))
    assert big_files and set(big_files) == {"ThreadPoolExecutor"}
    assert not leftovers(tmp_path)


def test_a_failing_thread_worker_leaves_nothing(tmp_path, model, big_files):
    flip_byte_in(tmp_path / "w4" / "rank-00002-of-00004.safetensors", "t5")
    with pytest.raises(CheckpointError, match="rank-00002-of-00004.safetensors"):
        reshard(str(tmp_path / "w4"), 8, str(tmp_path / "r8"), workers=2)
    assert not (tmp_path / "r8" / "zeroshard.json").exists()
    with pytest.raises(CheckpointError, match="rank-00002-of-00004.safetensors"):
        consolidate(str(tmp_path / "w4"), str(tmp_path / "m2.safetensors"), workers=2)
    assert not (tmp_path / "m2.safetensors").exists()
    report = verify(str(tmp_path / "w4"), workers=2)
    assert report.problems and all("rank-00002-of-00004.safetensors" in p for p in report.problems)
    assert set(big_files) == {"ThreadPoolExecutor"}
    assert not leftovers(tmp_path)


# ---- workers die with their parent (issue 17) -----------------------------------------------
def _children(pid: int) -> dict[int, str]:
    """Processes whose parent is `pid` (read from /proc: psutil may be missing), with their command lines."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid == pid:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue  # it ended while we looked
    return found


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkilled_command_takes_its_worker_processes_along(tmp_path):
    g = torch.Generator().manual_seed(5)
    save_file({f"t{i}": torch.randn(50 + 17 * i, generator=g) for i in range(60)}, str(tmp_path / "m.safetensors"))
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "w400"), 400)  # many small files: process workers
    before = {p: p.read_bytes() for p in sorted((tmp_path / "w400").iterdir())}
    out = tmp_path / "out"
    cli = subprocess.Popen([sys.executable, "-m", "zeroshard.cli", "reshard", str(tmp_path / "w400"), "--to", "640",
                            "-o", str(out), "-j", "2", "-q"], env=dict(os.environ, OMP_NUM_THREADS="1"),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, workers_seen = time.monotonic() + 120, {}
        while time.monotonic() < deadline and cli.poll() is None:
            workers_seen = {p: c for p, c in _children(cli.pid).items() if "multiprocessing" in c}
            if sum("spawn_main" in c for c in workers_seen.values()) >= 2:
                break
            time.sleep(0.01)
        assert cli.poll() is None, f"the command ended before its workers were seen: {cli.stderr.read()[-2000:]}"
        assert sum("spawn_main" in c for c in workers_seen.values()) >= 2, workers_seen
        cli.send_signal(signal.SIGKILL)  # mid-run: its pool is still open
        cli.wait(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in workers_seen):
        time.sleep(0.1)
    left = {p: c for p, c in workers_seen.items() if _running(p)}
    for pid in left:  # don't leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphaned workers: {left}"
    assert not (out / "zeroshard.json").exists()
    result = subprocess.run([sys.executable, "-m", "zeroshard.cli", "clean", str(tmp_path), "--yes"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "removed" in result.stdout.lower(), result.stdout + result.stderr
    assert not [p for p in tmp_path.rglob(".zeroshard-*")], "clean left something behind"
    assert not list(out.iterdir()) if out.exists() else True
    assert {p: p.read_bytes() for p in sorted((tmp_path / "w400").iterdir())} == before


def test_a_worker_whose_parent_is_already_gone_ends_at_once():
    """The race: the parent died before the worker set itself up."""
    code = "from zeroshard.toolkit.workers import die_with_parent; die_with_parent(1 << 30); print('lived')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "lived" not in result.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_polling_watch_ends_a_worker_without_prctl():
    """Elsewhere than Linux a thread polls the parent: forced here by hiding the platform."""
    worker = ("import os, sys, time; sys.platform = 'darwin'\n"
              "from zeroshard.toolkit.workers import die_with_parent\n"
              "die_with_parent(os.getppid()); print('armed', flush=True); time.sleep(60)")
    parent = ("import subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', {worker!r}])\n"
              "print(child.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "armed"  # the child prints through the same pipe
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _running(child):
            time.sleep(0.1)
        ended = not _running(child)
        if not ended:
            os.kill(child, signal.SIGKILL)
        assert ended, "the worker outlived its parent"
    finally:
        if proc.poll() is None:
            proc.kill()
