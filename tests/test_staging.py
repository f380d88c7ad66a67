"""checkpointing/staging.py: device tensors to and from checkpoint bytes through two host windows.

On a CUDA machine the windows are pinned and the copies asynchronous (tests/test_engine_gpu.py
checks an engine's save and load there); the windowing, the hash checks and the reuse rule are
the same on the CPU, where these tests run.
"""

from __future__ import annotations

import pytest
import torch

from zeroshard.checkpointing.staging import Staging
from zeroshard.errors import CheckpointError
from zeroshard.format import CheckpointReader, open_checkpoint
from zeroshard.format.reader import fragments_of
from zeroshard.storage.safetensors_header import torch_dtype
from zeroshard.storage.stream_writer import SMALL_WRITE_BYTES

from checkpoints import training_state, write_checkpoint
from test_bad_input import flip_byte_in

TIER = "default"  # docs/TESTING.md


def test_windowed_reads_give_read_flats_bytes_for_any_range(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 3)
    location, manifest = open_checkpoint(str(tmp_path / "c"))
    checked = 0
    # windows smaller than an element (3 bytes), a few elements, and larger than any tensor
    for window in (3, 20, 1 << 20):
        staging = Staging("cpu", window_bytes=window)
        with CheckpointReader(location, manifest) as reader:
            for t in manifest.tensors.values():
                if t.role == "extra":
                    continue
                for start, end in ((0, t.numel), (t.numel // 3, t.numel - t.numel // 4)):
                    out = torch.full((end - start,), 7, dtype=torch_dtype(t.dtype))
                    staging.read(reader, t, start, out)
                    expected = reader.read_flat(t, start, end)
                    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), (t.name, start, window)
                    checked += 1
        staging.finish()
    assert checked > 60


def test_windowed_reads_still_check_each_fragments_hash(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 2)
    rank1 = tmp_path / "c" / "rank-00001-of-00002.safetensors"
    flip_byte_in(rank1, "embed.weight")
    location, manifest = open_checkpoint(str(tmp_path / "c"))
    t = manifest.tensors["embed.weight"]
    with CheckpointReader(location, manifest) as reader:
        try:
            Staging("cpu", window_bytes=16).read(reader, t, 0, torch.empty(t.numel))
        except CheckpointError as exc:
            assert rank1.name in str(exc) and "hash mismatch" in str(exc)
        else:
            raise AssertionError("a flipped byte read window by window was not noticed")


def test_windows_give_a_tensors_bytes_and_alternate_two_buffers():
    window = SMALL_WRITE_BYTES
    tensor = torch.arange(window, dtype=torch.float32)  # 4 windows of bytes
    staging = Staging("cpu", window_bytes=window)
    views, held = [], []
    part = tensor[10:window - 8192]  # 3 windows and a tail under SMALL_WRITE_BYTES
    for view in staging.windows(part):
        held.append(bytes(view))
        views.append(view)
    assert b"".join(held) == part.numpy().tobytes()
    assert [len(v) for v in views] == [window] * 3 + [part.numel() * 4 - 3 * window]
    # a window is reused only after the next one was handed out (what a write-behind writer needs);
    # the small tail is not a window: the stream writer gathers it, which finishes no write
    addresses = [torch.frombuffer(v, dtype=torch.uint8).data_ptr() for v in views]
    assert addresses[0] != addresses[1] and addresses[0] == addresses[2]
    assert addresses[3] not in addresses[:3]


def test_windows_written_behind_reach_the_file_unchanged(tmp_path, monkeypatch):
    """Windows of big tensors with small tensors between them, through a write-behind stream
    writer whose writes are slow: each write still sends the bytes that were hashed. (A small
    piece in a window let the next big one reuse the window of a write still in flight: on an
    H100, a checkpoint that failed its own hash check on load.)"""
    import time

    import numpy as np
    from safetensors.numpy import load_file

    from zeroshard.storage.location import AtomicWriter, Location
    from zeroshard.storage.stream_writer import SafetensorsStreamWriter

    write_now = AtomicWriter._write_now

    def slow_write(self, view):
        time.sleep(0.02)  # still in flight while the caller fills its next window
        write_now(self, view)

    monkeypatch.setattr(AtomicWriter, "_write_now", slow_write)
    window = SMALL_WRITE_BYTES
    sizes = [window // 4 * 3 // 2, 100, window // 4, 50, window // 2, window // 4 + 7, 10]  # fp32 elements
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for n in sizes]
    layout = [(f"t{i}", "F32", (n,)) for i, n in enumerate(sizes)]
    staging = Staging("cpu", window_bytes=window)
    with SafetensorsStreamWriter(Location(str(tmp_path)), "x.safetensors", layout, {}, write_behind=True) as out:
        for t in tensors:
            for view in staging.windows(t):
                out.write(view)
    got = load_file(str(tmp_path / "x.safetensors"))
    assert [i for i, t in enumerate(tensors) if not np.array_equal(got[f"t{i}"], t.numpy())] == []


def test_windowed_partial_reads_hash_each_fragments_unread_rest_once(tmp_path):
    """A load at another world size reads part of a saved fragment: the rest is read and hashed
    too (complete_fragments), once per read however many windows it takes."""
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 3)
    location, manifest = open_checkpoint(str(tmp_path / "c"))
    t = manifest.tensors["embed.weight"]
    start, end = t.numel // 3 + 5, t.numel - t.numel // 5
    touched = list(fragments_of(t, 3, start, end))
    assert len(touched) == 2  # the range starts inside one rank's fragment and ends inside the next
    with CheckpointReader(location, manifest, complete_fragments=True) as reader:
        out = torch.empty(end - start)
        Staging("cpu", window_bytes=20).read(reader, t, start, out)
        assert reader.bytes_read == sum(hi - lo for _, lo, hi in touched) * t.itemsize
    assert torch.equal(out, data["embed.weight"].reshape(-1)[start:end])

    rank1 = tmp_path / "c" / "rank-00001-of-00003.safetensors"
    flip_byte_in(rank1, "embed.weight")  # in the middle of rank 1's fragment
    rank, lo, hi = touched[0]
    assert rank == 1 and lo < start < (lo + hi) // 2 - 2
    location, manifest = open_checkpoint(str(tmp_path / "c"))
    with CheckpointReader(location, manifest, complete_fragments=True) as reader:
        try:  # only rank 1's first elements are wanted: the flipped byte is in the part read to be hashed
            Staging("cpu", window_bytes=8).read(reader, t, lo + 1, torch.empty(3))
        except CheckpointError as exc:
            assert rank1.name in str(exc) and "hash mismatch" in str(exc)
        else:
            raise AssertionError("a flipped byte in the unread rest of a fragment was not noticed")


def test_reads_hashed_behind_give_the_same_bytes_and_catch_a_flipped_byte(tmp_path):
    """CheckpointReader(hash_behind=True): the hashing runs on a thread while the next read goes
    on; whole and partial reads (complete_fragments), straight or through windows, give the bytes
    an inline-hashing reader gives, and a flipped byte is an error naming the file and tensor, at
    settle() or at the latest when the `with` block is left, never dropped."""
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 3)
    location, manifest = open_checkpoint(str(tmp_path / "c"))
    tensors = [t for t in manifest.tensors.values() if t.role != "extra"]
    with CheckpointReader(location, manifest, complete_fragments=True) as inline, \
            CheckpointReader(location, manifest, complete_fragments=True, hash_behind=True) as behind:
        assert behind.hash_mark() == 0
        for t in tensors:
            for start, end in ((0, t.numel), (t.numel // 3, t.numel - t.numel // 4)):
                want = inline.read_flat(t, start, end)
                got = torch.full((end - start,), 7, dtype=want.dtype)
                if end > start:
                    behind.read_into(t, start, memoryview(got.view(torch.uint8).numpy()))
                windowed = torch.full_like(got, 7)
                Staging("cpu", window_bytes=24).read(behind, t, start, windowed)
                behind.settle()
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (t.name, start)
                assert torch.equal(windowed.view(torch.uint8), want.view(torch.uint8)), (t.name, start)
        assert behind.hash_mark() > 0  # the hashing did go to the thread

    rank1 = tmp_path / "c" / "rank-00001-of-00003.safetensors"
    flip_byte_in(rank1, "embed.weight")
    t = manifest.tensors["embed.weight"]
    owned = [(s, e) for r, s, e in fragments_of(t, 3) if r == 1][0]
    with pytest.raises(CheckpointError, match=f"{rank1.name}.*embed.weight.*hash mismatch"):
        with CheckpointReader(location, manifest, hash_behind=True) as reader:
            out = torch.empty(owned[1] - owned[0])
            reader.read_into(t, owned[0], memoryview(out.view(torch.uint8).numpy()))
            reader.settle()
    with pytest.raises(CheckpointError, match=f"{rank1.name}.*embed.weight.*hash mismatch"):
        with CheckpointReader(location, manifest, hash_behind=True) as reader:  # no settle: leaving checks
            out = torch.empty(owned[1] - owned[0])
            reader.read_into(t, owned[0], memoryview(out.view(torch.uint8).numpy()))
