"""The public storage calls the toolkit uses instead of os.open/os.write/os.fsync (issue 20):
temp names leftovers.py recognises, exclusive creation with deferred durability, whole-file
reads that decline rather than fail."""

import os

from zeroshard.storage.leftovers import find_leftovers
from zeroshard.storage.location import Location, is_temp_name


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
