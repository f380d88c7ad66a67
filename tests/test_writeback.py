"""storage/writeback.py: a big local write starts its write-out to disk as it goes ([Note: early
writeback]), in every place that writes big files, and never changes what lands in them.

The speed it buys is measured by tools/bench_toolkit.py (CHANGELOG); here: that the hint is
issued, on the right file, at the right pace, and that it is harmless where it cannot act.
"""

from __future__ import annotations

import os
import sys

import pytest

from zeroshard.storage import writeback
from zeroshard.storage.location import TEMP_PREFIX, Location
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.reshard import reshard

from checkpoints import read_checkpoint, training_state, write_checkpoint

TIER = "default"  # docs/TESTING.md


@pytest.fixture
def kicks(monkeypatch):
    """Every start_writeback call, as (path of the descriptor, offset, length, flags)."""
    calls: list[tuple[str, int, int, int]] = []

    def record(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, flags))
        return 0

    monkeypatch.setattr(writeback, "_sync_file_range", lambda: record)
    return calls


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


@linux_only
def test_an_atomic_write_starts_the_write_out_of_its_temp_file_every_writeback_bytes(tmp_path, monkeypatch, kicks):
    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", 1 << 20)
    data = os.urandom(5 * (1 << 20) + 12345)
    with Location(str(tmp_path)).atomic_writer("big.bin", write_behind=True) as out:
        for at in range(0, len(data), 256 * 1024):
            out.write(data[at:at + 256 * 1024])
    assert (tmp_path / "big.bin").read_bytes() == data
    assert len(kicks) == 5  # one per whole MiB written, none for the tail: the fsync takes it
    assert {os.path.dirname(path) for path, *_ in kicks} == {str(tmp_path)}
    assert all(os.path.basename(path) != "big.bin" for path, *_ in kicks)  # the temp file, before the rename
    assert {(offset, length, flags) for _, offset, length, flags in kicks} == {(0, 0, 2)}


@linux_only
@pytest.mark.parametrize("command", ["consolidate", "reshard"])
def test_toolkit_outputs_start_their_write_out_and_keep_their_bytes(tmp_path, monkeypatch, kicks, command):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ck"), specs, data, 3)

    def run(out: str) -> None:
        if command == "consolidate":
            consolidate(str(tmp_path / "ck"), out)
        else:
            reshard(str(tmp_path / "ck"), 2, out)

    suffix = ".safetensors" if command == "consolidate" else ""
    plain, kicked = tmp_path / f"plain{suffix}", tmp_path / f"kicked{suffix}"
    run(str(plain))
    assert not kicks  # a small checkpoint never reaches the default pace
    monkeypatch.setattr(writeback, "WRITEBACK_BYTES", 512)  # outputs of a few kB
    run(str(kicked))
    assert kicks, "no write-out started"
    inside = str(kicked.parent if suffix else kicked) + os.sep  # a reshard stages in the output folder
    assert all(path.startswith(inside) for path, *_ in kicks)
    assert all(os.path.basename(path).startswith(TEMP_PREFIX) for path, *_ in kicks)  # before their rename
    if command == "consolidate":
        assert kicked.read_bytes() == plain.read_bytes()
    else:
        before, after = read_checkpoint(str(plain)), read_checkpoint(str(kicked))
        assert before.keys() == after.keys()
        assert all(before[name].equal(after[name]) for name in before)


def test_the_pacer_is_due_once_per_every_bytes():
    pacer = writeback.WritebackPacer(every=100)
    assert [pacer.due(n) for n in (40, 40, 40, 99, 1, 250)] == [False, False, True, False, True, True]


@linux_only
def test_start_writeback_is_a_harmless_hint(tmp_path):
    assert writeback._sync_file_range() is not None  # glibc and musl both have it
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"x" * 100_000)
        writeback.start_writeback(fd)  # a real file: starts its write-out, returns at once
    finally:
        os.close(fd)
    writeback.start_writeback(fd)  # a closed descriptor: the call fails, and that is ignored
    dev_null = os.open(os.devnull, os.O_WRONLY)
    try:
        writeback.start_writeback(dev_null)  # not a regular file
    finally:
        os.close(dev_null)
    assert path.read_bytes() == b"x" * 100_000
