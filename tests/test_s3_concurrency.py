"""Concurrent ranged GETs and multipart uploads against a real HTTP S3 endpoint (moto, see conftest):
exact bytes, bounded requests in flight, one-line errors naming the URL, nothing left behind."""

import asyncio
import random

import pytest

from zeroshard.errors import StorageError, ZeroshardError
from zeroshard.storage import AtomicWriter, Location
from zeroshard.storage.read_ahead import read_ranges
from zeroshard.storage.remote_io import MiB, RemoteIO, split_options

TIER = "default"  # docs/TESTING.md

pytestmark = pytest.mark.s3

BLOCK = 64 * 1024
DEPTH = 4


class Probe:
    """Wraps one of the filesystem's coroutines: counts calls in flight (and the most at once),
    bytes fetched, cancellations; delays calls (seconds, or a function of the call's arguments)
    and fails chosen ones. `counted(*args)` picks the calls counted in flight: the filesystem is
    shared (fsspec caches instances), so another thread's request may pass through it too."""

    def __init__(self, original, delay=0.02, fail=None, counted=None):
        self.original, self.delay, self.fail = original, delay, fail
        self.counted = counted or (lambda *args, **kwargs: True)
        self.now = self.most = self.calls = self.cancelled = 0
        self.fetched = 0
        self.methods = []

    async def __call__(self, *args, **kwargs):
        if not self.counted(*args, **kwargs):
            return await self.original(*args, **kwargs)
        self.now += 1
        self.calls += 1
        self.most = max(self.most, self.now)
        self.methods.append(args[0] if args else "cat_file")
        try:
            await asyncio.sleep(self.delay(*args, **kwargs) if callable(self.delay) else self.delay)
            if self.fail is not None and self.fail(*args, **kwargs):
                raise OSError(5, "simulated network failure\nsecond line")
            out = await self.original(*args, **kwargs)
            if isinstance(out, (bytes, bytearray)):
                self.fetched += len(out)
            return out
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.now -= 1


def remote(url, **options):
    return Location(url, {"zeroshard_block_size": BLOCK, "zeroshard_read_ahead": DEPTH, **options})


@pytest.fixture
def blob(s3_bucket, s3_client):
    """A 5.3-block object of random bytes; returns (location, name, bytes)."""
    data = random.Random(0).randbytes(5 * BLOCK + 12345)
    s3_client.put_object(Bucket=s3_bucket[5:], Key="blob.bin", Body=data)
    return remote(s3_bucket), "blob.bin", data


def probe(monkeypatch, location, method="_cat_file", **kwargs):
    p = Probe(getattr(location.fs, method), **kwargs)
    monkeypatch.setattr(location.fs, method, p)
    return p


def test_sequential_runs_are_exact_and_read_ahead_within_the_bound(blob, monkeypatch):
    location, name, data = blob
    p = probe(monkeypatch, location)
    sizes = [8, 1000, BLOCK - 1008, 3, BLOCK + 17, 2 * BLOCK + 5, 7, BLOCK, BLOCK]  # across and along block edges
    with location.open_reader(name, size=len(data)) as reader:
        pos = 0
        for size in sizes:
            size = min(size, len(data) - pos)
            assert reader.read(pos, size) == data[pos:pos + size]
            assert reader._remote.in_flight() <= DEPTH
            pos += size
        assert pos == len(data)
    assert 1 < p.most <= DEPTH  # blocks really went out together, never more than the depth
    assert p.fetched <= len(data) + BLOCK  # read-ahead stops at the file end


def test_random_reads_are_exact_and_fetch_only_what_is_asked(blob, monkeypatch):
    location, name, data = blob
    p = probe(monkeypatch, location)
    rng = random.Random(1)
    asked = 0
    with location.open_reader(name) as reader:
        for _ in range(40):
            start = rng.randrange(len(data))
            length = rng.randint(1, min(len(data) - start, 3 * BLOCK))
            assert reader.read(start, length) == data[start:start + length]
            asked += length
        tail = len(data) - 10
        assert reader.read(tail, 10) == data[tail:]  # up to the end exactly
        asked += 10
    assert p.fetched == asked  # jumping about, nothing is fetched that was not asked for
    assert p.most <= DEPTH


def test_back_and_forth_inside_a_run(blob):
    location, name, data = blob
    with location.open_reader(name) as reader:
        for start, length in [(0, BLOCK), (BLOCK, BLOCK), (2 * BLOCK, 100), (2 * BLOCK - 50, 200),
                              (2 * BLOCK + 150, 3 * BLOCK), (10, 20), (20, 2 * BLOCK)]:
            assert reader.read(start, length) == data[start:start + length]


def test_reading_past_the_end_is_a_truncation_error(blob):
    location, name, data = blob
    with location.open_reader(name) as reader:
        reader.read(0, 2 * BLOCK)
        with pytest.raises(StorageError, match="truncated") as err:
            reader.read(2 * BLOCK, len(data))  # runs on in order, past the end
    assert "blob.bin" in str(err.value)


def test_a_failed_get_mid_way_is_one_line_naming_the_url(blob, monkeypatch):
    location, name, data = blob
    probe(monkeypatch, location, fail=lambda path, start=None, end=None, **_: (start or 0) >= 3 * BLOCK)
    with location.open_reader(name) as reader:
        assert reader.read(0, 3 * BLOCK) == data[:3 * BLOCK]  # the blocks before the failure are fine
        with pytest.raises(StorageError) as err:
            reader.read(3 * BLOCK, BLOCK)
    message = str(err.value)
    assert message.startswith(location.url_of(name)) and "simulated network failure" in message
    assert "\n" not in message


def test_an_object_deleted_mid_read_is_a_storage_error(blob, s3_client):
    location, name, data = blob
    with location.open_reader(name) as reader:
        reader.read(0, 100)
        s3_client.delete_object(Bucket=location.url[5:], Key=name)
        with pytest.raises(StorageError, match="blob.bin"):
            for start in range(100, len(data), BLOCK // 2):
                reader.read(start, min(BLOCK // 2, len(data) - start))


def until_idle(p):
    for _ in range(300):
        if p.now == 0:
            return
        asyncio.run(asyncio.sleep(0.01))


def test_closing_a_reader_cancels_its_gets(blob, monkeypatch):
    location, name, data = blob
    # GETs from block 3 on (the ones read ahead of the second read) hang until cancelled
    p = probe(monkeypatch, location, delay=lambda path, start=0, **_: 30.0 if start >= 3 * BLOCK else 0.0)
    reader = location.open_reader(name)
    reader.read(0, BLOCK)
    assert reader.read(BLOCK, BLOCK + 1) == data[BLOCK:2 * BLOCK + 1]  # in order: blocks 3 and 4 go out ahead
    assert reader._remote.in_flight() > 0
    reader.close()
    assert reader._remote.in_flight() == 0
    until_idle(p)
    # the requests themselves were stopped (cancelled while waiting, or before they started):
    # none of the hanging blocks ever arrived
    assert p.now == 0 and p.fetched <= 3 * BLOCK
    assert location.read_budget.held == 0


def test_read_ranges_across_many_files_in_order(s3_bucket, s3_client, monkeypatch):
    rng = random.Random(2)
    location = remote(s3_bucket)
    files = {f"rank-{i:03d}.bin": rng.randbytes(rng.randint(1, 3 * BLOCK)) for i in range(30)}
    for key, body in files.items():
        s3_client.put_object(Bucket=s3_bucket[5:], Key=key, Body=body)
    ranges = []
    for key, body in files.items():
        ranges.append((key, 0, min(8, len(body))))
        start = rng.randrange(len(body))
        ranges.append((key, start, len(body) - start))  # some cross block edges, some are many blocks
    ranges.append(("rank-000.bin", 0, 0))
    p = probe(monkeypatch, location)
    got = list(read_ranges(location, ranges, max_requests=5))
    assert got == [files[key][start:start + length] for key, start, length in ranges]
    assert 1 < p.most <= 5
    assert p.fetched == sum(length for _, _, length in ranges)


def test_read_ranges_errors_and_early_close(s3_bucket, s3_client, tmp_path, monkeypatch):
    location = remote(s3_bucket)
    s3_client.put_object(Bucket=s3_bucket[5:], Key="a.bin", Body=b"a" * 100)
    with pytest.raises(StorageError, match=r"a\.bin: file is truncated"):
        list(read_ranges(location, [("a.bin", 0, 10), ("a.bin", 50, 60)]))
    with pytest.raises(StorageError, match="missing.bin: not found"):
        list(read_ranges(location, [("a.bin", 0, 10), ("missing.bin", 0, 10)]))
    p = probe(monkeypatch, location, delay=lambda path, start=0, **_: 30.0 if start > 0 else 0.0)
    ranges = read_ranges(location, [("a.bin", i, 1) for i in range(50)], max_requests=3)
    assert next(ranges) == b"a"  # the others hang until cancelled
    ranges.close()
    until_idle(p)
    assert p.now == 0 and p.cancelled > 0 and p.most <= 3
    (tmp_path / "l.bin").write_bytes(b"0123456789")
    assert list(read_ranges(Location(str(tmp_path)), [("l.bin", 2, 3), ("l.bin", 0, 0)])) == [b"234", b""]


PART = 5 * MiB


def test_concurrent_multipart_upload_is_exact_and_bounded(s3_bucket, monkeypatch):
    location = Location(s3_bucket, {"zeroshard_part_size": "5MiB", "zeroshard_uploads_in_flight": 3})
    p = probe(monkeypatch, location, method="_call_s3", delay=0.05,
              counted=lambda method, *a, **kw: kw.get("Key") == "big.bin")
    data = random.Random(3).randbytes(4 * PART + 12345)
    with location.atomic_writer("big.bin") as out:
        assert out._file.__class__.__name__ == "ConcurrentMultipartUpload"
        for start in range(0, len(data), 3 * MiB + 7):  # writes not aligned to parts
            out.write(data[start:start + 3 * MiB + 7])
            assert out._file.in_flight() <= 3
    assert location.read_bytes("big.bin") == data
    assert p.methods.count("upload_part") == 5 and p.methods.count("complete_multipart_upload") == 1
    assert 1 < p.most <= 3  # parts upload together, never more than asked (create and complete run alone)


def test_write_behind_multipart_and_small_files(s3_bucket, s3_client):
    location = Location(s3_bucket, {"zeroshard_part_size": "5MiB", "zeroshard_uploads_in_flight": 2})
    data = random.Random(4).randbytes(2 * PART + 1)
    buffers = [bytearray(MiB), bytearray(MiB)]
    with AtomicWriter(location, "wb.bin", write_behind=True) as out:
        for i, start in enumerate(range(0, len(data), MiB)):
            chunk = data[start:start + MiB]
            buffers[i % 2][:len(chunk)] = chunk
            out.write(memoryview(buffers[i % 2])[:len(chunk)])
    assert location.read_bytes("wb.bin") == data
    location.write_bytes("small.json", b"{}")
    assert location.read_bytes("small.json") == b"{}"
    assert not s3_client.list_multipart_uploads(Bucket=s3_bucket[5:]).get("Uploads")


def test_a_failed_part_aborts_the_upload(s3_bucket, s3_client, monkeypatch):
    location = Location(s3_bucket, {"zeroshard_part_size": "5MiB", "zeroshard_uploads_in_flight": 3})
    probe(monkeypatch, location, method="_call_s3",
          fail=lambda method, *a, **kw: method == "upload_part" and kw.get("PartNumber") == 3)
    with pytest.raises(StorageError) as err:
        with location.atomic_writer("big.bin") as out:
            for _ in range(6):
                out.write(b"z" * PART)
    message = str(err.value)
    assert message.startswith(location.url_of("big.bin")) and "simulated" in message and "\n" not in message
    bucket = s3_bucket[5:]
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket)
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_a_failed_completion_aborts_the_upload(s3_bucket, s3_client, monkeypatch):
    location = Location(s3_bucket, {"zeroshard_part_size": "5MiB"})
    probe(monkeypatch, location, method="_call_s3", fail=lambda method, *a, **kw: method == "complete_multipart_upload")
    with pytest.raises(StorageError, match="big.bin"):
        with location.atomic_writer("big.bin") as out:
            out.write(b"z" * (2 * PART + 1))
    bucket = s3_bucket[5:]
    assert "Contents" not in s3_client.list_objects_v2(Bucket=bucket)
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_storage_options():
    settings, rest = split_options({"zeroshard_block_size": "8MiB", "zeroshard_read_ahead": 2, "anon": True})
    assert settings == RemoteIO(block_bytes=8 * MiB, read_ahead=2) and rest == {"anon": True}
    with pytest.raises(ZeroshardError, match="zeroshard_part_size"):
        split_options({"zeroshard_part_size": "1MiB"})  # below S3's smallest part
    with pytest.raises(ZeroshardError, match="zeroshard_readahead"):
        split_options({"zeroshard_readahead": 4})
    with pytest.raises(ZeroshardError, match="byte count"):
        split_options({"zeroshard_block_size": "lots"})


def test_read_ahead_across_files_shares_one_budget(s3_bucket, s3_client):
    """Files read in turn (as consolidate reads every rank) hold no more blocks ahead, together,
    than one reader may."""
    location = remote(s3_bucket)
    bodies = {f"f{i}": random.Random(i).randbytes(6 * BLOCK) for i in range(3)}
    for key, body in bodies.items():
        s3_client.put_object(Bucket=s3_bucket[5:], Key=key, Body=body)
    readers = {key: location.open_reader(key) for key in bodies}
    most = 0
    try:
        for start in range(0, 6 * BLOCK, BLOCK // 2):
            for key, reader in readers.items():
                assert reader.read(start, BLOCK // 2) == bodies[key][start:start + BLOCK // 2]
                most = max(most, location.read_budget.held)
                assert location.read_budget.held <= DEPTH
        assert most > 0  # blocks were fetched ahead
    finally:
        for reader in readers.values():
            reader.close()
    assert location.read_budget.held == 0


def test_a_filesystem_without_async_reads_through_the_thread_pool():
    """Any remote fsspec filesystem gets the same reads (here fsspec's in-memory one)."""
    import uuid

    location = Location(f"memory://zs-{uuid.uuid4().hex[:8]}", {"zeroshard_block_size": BLOCK})
    data = random.Random(5).randbytes(3 * BLOCK + 99)
    location.fs.pipe_file(location.full_path("m.bin"), data)
    assert not location.local and not getattr(location.fs, "async_impl", False)
    with location.open_reader("m.bin") as reader:
        assert reader.read(0, 10) == data[:10]
        pos = 10
        while pos < len(data):
            n = min(BLOCK // 3, len(data) - pos)
            assert reader.read(pos, n) == data[pos:pos + n]
            pos += n
        assert reader.read(BLOCK - 5, 2 * BLOCK) == data[BLOCK - 5:3 * BLOCK - 5]
    assert list(read_ranges(location, [("m.bin", 5, 2 * BLOCK), ("m.bin", 0, 3)])) == [data[5:5 + 2 * BLOCK], data[:3]]
