"""The public storage calls the toolkit uses instead of os.open/os.write/os.fsync (issue 20):
temp names leftovers.py recognises, exclusive creation with deferred durability, whole-file
reads that decline rather than fail."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.storage.leftovers import find_leftovers
from zeroshard.storage.location import Location, is_temp_name

TIER = "default"  # docs/TESTING.md


def test_temp_names_are_fresh_hidden_and_found_as_leftovers_of_a_live_writer(tmp_path):
    loc = Location(tmp_path)
    a, b = loc.temp_name("rank-00000-of-00002.safetensors"), loc.temp_name("rank-00000-of-00002.safetensors")
    assert a != b and is_temp_name(a) and a.endswith("-rank-00000-of-00002.safetensors")
    assert not is_temp_name("rank-00000-of-00002.safetensors")
    assert loc.create_exclusive(a, memoryview(b"x" * 10), durable=False)
    assert not loc.create_exclusive(a, b"other")  # never replaces
    assert (tmp_path / a).read_bytes() == b"x" * 10
    found = find_leftovers(loc)
    assert [(f.kind, f.alive) for f in found] == [("temp file", True)]  # this process owns it: not stale
    loc.fsync([a])
    loc.remove(a)
    assert not find_leftovers(loc)
    deeper = Location(tmp_path / "new" / "deeper")  # a folder not there yet is made on the way
    assert deeper.create_exclusive(deeper.temp_name("x"), b"1", durable=False) and len(deeper.list()) == 1


def test_read_whole_into_declines_what_it_cannot_read_exactly(tmp_path):
    loc = Location(tmp_path)
    (tmp_path / "f").write_bytes(b"abcdef")
    buf = bytearray(6)
    assert loc.read_whole_into("f", memoryview(buf)) and bytes(buf) == b"abcdef"
    assert not loc.read_whole_into("f", memoryview(bytearray(5)))  # another size
    assert not loc.read_whole_into("missing", memoryview(bytearray(6)))
    os.symlink(tmp_path / "f", tmp_path / "link")
    assert not loc.read_whole_into("link", memoryview(bytearray(6)))  # a link: never followed
    os.mkfifo(tmp_path / "fifo")
    assert not loc.read_whole_into("fifo", memoryview(bytearray(6)))  # refused, not waited on


def test_read_whole_into_declines_remote_files():
    remote = Location.__new__(Location)
    remote.local = False  # no network needed: the local fast path is simply not taken
    assert not Location.read_whole_into(remote, "f", memoryview(bytearray(1)))


KILLED_CREATE = """
import os, signal, sys
from zeroshard.storage.location import Location
loc = Location(sys.argv[1])
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
setattr(os, sys.argv[2], die)  # the process dies at this call, as under a node's SIGKILL
loc.create_exclusive("claim.json", b'{"owner": "a", "time": 1}')
"""


@pytest.mark.parametrize("dies_at", ["write", "fsync", "link"])
def test_a_durable_create_killed_half_way_leaves_no_torn_file(tmp_path: Path, dies_at: str) -> None:
    """Claims and the memory tier's owner file are read by other processes: killed between its
    create and its write, the old O_EXCL create left an empty claim.json that every later writer
    took for a live claim (or an unreadable owner) until someone removed it by hand."""
    proc = subprocess.run([sys.executable, "-c", KILLED_CREATE, str(tmp_path), dies_at], timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == -9
    assert not (tmp_path / "claim.json").exists()
    left = os.listdir(tmp_path)
    assert len(left) == 1 and is_temp_name(left[0])  # what `zeroshard clean` removes: a dead writer's temp
    [found] = find_leftovers(Location(tmp_path))
    assert found.kind == "temp file" and found.alive is False
    loc = Location(tmp_path)
    assert loc.create_exclusive("claim.json", b"whole")
    assert (tmp_path / "claim.json").read_bytes() == b"whole"
    assert not loc.create_exclusive("claim.json", b"again")  # still exclusive
    assert sorted(os.listdir(tmp_path)) == sorted([*left, "claim.json"])  # no temp of its own left


def test_remove_takes_a_folder_a_file_or_a_link_itself_and_never_what_a_link_points_at(tmp_path):
    loc = Location(tmp_path / "root")
    (tmp_path / "root" / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "root" / "tree" / "sub" / "f").write_bytes(b"1")
    (tmp_path / "root" / "file").write_bytes(b"2")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "keep").write_bytes(b"3")
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "link")
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "tree" / "inner-link")
    loc.remove("tree", recursive=True)  # a link inside the tree goes, its target stays
    loc.remove("file", recursive=True)
    loc.remove("link", recursive=True)
    loc.remove("missing", recursive=True)  # gone already: nothing to do
    assert os.listdir(tmp_path / "root") == []
    assert (tmp_path / "elsewhere" / "keep").read_bytes() == b"3"
