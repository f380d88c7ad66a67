"""Output hashes taken during the copy (zeroshard/toolkit/output_hashes.py): equal to hashes of
the finished file when the bytes came in order, absent (and then computed from the file) when
they did not; and the big-file copy path that feeds them still checks every input byte."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from zeroshard.errors import CheckpointError
from zeroshard.storage.hashing import hash_bytes
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.output_hashes import InOrderHashes
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.shard import shard
from zeroshard.toolkit.verify import verify

from test_bad_input import flip_byte_in
from test_roundtrip import assert_same

TIER = "default"  # docs/TESTING.md

HEADER = b"HDR-"
FILE = HEADER + bytes(range(256)) * 4 + b"TAIL"  # regions [4, 516) and [516, 1028), tail at 1028
REGIONS = [(4, 516), (516, 1028)]


def feed(hashes: InOrderHashes, *ranges: tuple[int, int]) -> None:
    for begin, end in ranges:
        hashes.feed(begin, memoryview(FILE)[begin:end])


def test_in_order_feeds_give_the_hashes_of_the_file():
    hashes = InOrderHashes(HEADER, REGIONS)
    feed(hashes, (4, 100), (100, 516), (516, 517), (517, 1028))
    assert hashes.region_hash(0) == hash_bytes(FILE[4:516])
    assert hashes.region_hash(1) == hash_bytes(FILE[516:1028])
    assert hashes.file_hash(1028, b"TAIL") == hash_bytes(FILE)


def test_regions_in_order_but_file_out_of_order():
    """The second region first (as when an output draws on two inputs): each region's hash
    holds, the file's does not."""
    hashes = InOrderHashes(HEADER, REGIONS)
    feed(hashes, (516, 1028), (4, 516))
    assert hashes.region_hash(0) == hash_bytes(FILE[4:516])
    assert hashes.region_hash(1) == hash_bytes(FILE[516:1028])
    assert hashes.file_hash(1028, b"TAIL") is None


@pytest.mark.parametrize("ranges", [
    [(4, 100), (200, 516), (100, 200)],  # a region out of order
    [(4, 100), (101, 516)],              # a gap: a byte never fed (written some other way)
    [(100, 516)],                        # the start missing
])
def test_out_of_order_or_missing_bytes_leave_no_hash(ranges):
    hashes = InOrderHashes(HEADER, REGIONS)
    feed(hashes, *ranges, (516, 1028))
    assert hashes.region_hash(0) is None
    assert hashes.region_hash(1) == hash_bytes(FILE[516:1028])
    assert hashes.file_hash(1028, b"TAIL") is None


def test_empty_regions_hash_as_empty():
    hashes = InOrderHashes(HEADER, [(4, 4), (4, 8)])
    feed(hashes, (4, 8))
    assert hashes.region_hash(0) == hash_bytes(b"")
    assert hashes.file_hash(8, b"") == hash_bytes(FILE[:8])


@pytest.fixture
def small_windows(monkeypatch):
    """Every file goes through the big-file path, in windows of 4 KiB and steps of 1 KiB; counts
    the regions hashed by reading the finished output."""
    import zeroshard.toolkit.gather as gather
    import zeroshard.toolkit.transfer as transfer

    monkeypatch.setattr(gather, "WHOLE_HASH_BYTES", 0)  # no input is read whole
    monkeypatch.setattr(transfer, "WINDOW_BYTES", 4096)
    monkeypatch.setattr(transfer, "STEP_BYTES", 1024)
    reread = []
    original = transfer._hash_region
    monkeypatch.setattr(transfer, "_hash_region",
                        lambda out, begin, end: reread.append((begin, end)) or original(out, begin, end))
    return reread


@pytest.fixture
def model(tmp_path):
    """Every size a multiple of 4, so that each rank of 4 lies inside one rank of 2."""
    g = torch.Generator().manual_seed(7)
    tensors = {"big": torch.randn(10_000, generator=g), "odd": torch.randn(3, 332, generator=g),
               "small": torch.arange(8, dtype=torch.int64), "half": torch.randn(2048, generator=g).half()}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "w2"), 2)
    return tensors


def test_reshard_within_inputs_takes_every_hash_during_the_copy(tmp_path, model, small_windows):
    """2 -> 4: every output lies inside one input, so it is written front to back and no output
    byte is read again; the result verifies fragment by fragment."""
    reshard(str(tmp_path / "w2"), 4, str(tmp_path / "w4"))
    assert small_windows == []
    assert verify(str(tmp_path / "w4"), deep=True).ok
    consolidate(str(tmp_path / "w4"), str(tmp_path / "o.safetensors"))
    assert_same(model, load_file(tmp_path / "o.safetensors"))


def test_reshard_across_inputs_reads_them_side_by_side(tmp_path, model, small_windows):
    """2 -> 3: the middle output draws on both inputs. Read side by side, tensor by tensor, both
    inputs still go front to back and every output is written front to back: no output byte is
    read again."""
    reshard(str(tmp_path / "w2"), 3, str(tmp_path / "w3"))
    assert small_windows == []
    assert verify(str(tmp_path / "w3"), deep=True).ok
    consolidate(str(tmp_path / "w3"), str(tmp_path / "o.safetensors"))
    assert_same(model, load_file(tmp_path / "o.safetensors"))


def test_inputs_one_after_the_other_fall_back_for_the_file_hash(tmp_path, model, small_windows, monkeypatch):
    """With too many inputs to hold open, they are read one after the other: the middle output's
    file hash (only) is computed from the finished file, and every hash still verifies."""
    import zeroshard.toolkit.transfer as transfer

    monkeypatch.setattr(transfer, "MAX_OPEN_INPUTS", 1)
    reshard(str(tmp_path / "w2"), 3, str(tmp_path / "w3"))
    assert len(small_windows) == 1 and small_windows[0][0] == 0  # one whole-file read, nothing else
    assert verify(str(tmp_path / "w3"), deep=True).ok
    consolidate(str(tmp_path / "w3"), str(tmp_path / "o.safetensors"))
    assert_same(model, load_file(tmp_path / "o.safetensors"))


def test_big_file_path_still_checks_every_input_byte(tmp_path, model, small_windows):
    flip_byte_in(tmp_path / "w2" / "rank-00001-of-00002.safetensors", "odd")
    with pytest.raises(CheckpointError, match="rank-00001-of-00002.safetensors.*'odd'.*hash mismatch"):
        reshard(str(tmp_path / "w2"), 4, str(tmp_path / "w4"))
    assert not (tmp_path / "w4").exists() or not (tmp_path / "w4" / "zeroshard.json").exists()
