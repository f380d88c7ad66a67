"""interop/torch_zip.py: torch.save archives read by record and by byte range, bit-exact against
torch.load, and hostile archives refused in one line naming the file, nothing run."""

from __future__ import annotations

import enum
import os
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from zeroshard.errors import CheckpointError
from zeroshard.interop import torch_zip
from zeroshard.interop.imported import LazyTensor, materialize

TIER = "default"  # docs/TESTING.md


def _same(mine, theirs, where="") -> None:
    mine = materialize(mine)
    if torch.is_tensor(theirs):
        assert torch.is_tensor(mine) and mine.dtype == theirs.dtype and mine.shape == theirs.shape, where
        assert torch.equal(mine, theirs), where
    elif isinstance(theirs, dict):
        assert list(mine) == list(theirs), where
        for key in theirs:
            _same(mine[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(mine) is type(theirs) and len(mine) == len(theirs), where
        for i, (a, b) in enumerate(zip(mine, theirs)):
            _same(a, b, f"{where}[{i}]")
    elif hasattr(theirs, "__dict__") and not isinstance(theirs, enum.Enum):  # a stand-in (loss scaler)
        assert type(mine) is type(theirs), where
        _same(vars(mine), vars(theirs), where)
    else:
        assert type(mine) is type(theirs) and mine == theirs, where


def _sample() -> dict:
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(3000, generator=g)
    return {
        "big": torch.randn(300, 70, generator=g),  # 84 kB
        "view": flat[1000:2500].reshape(30, 50),  # shares `flat`'s storage, at an offset
        "flat": flat,
        "transposed": torch.randn(40, 30, generator=g).t(),  # non-contiguous
        "bf16": torch.randn(64, 33, generator=g).bfloat16(),
        "mask": torch.rand(100, generator=g) > 0.5,
        "ints": torch.arange(-50, 50, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "param": torch.nn.Parameter(torch.ones(7)),
        "nested": [(1, "a", torch.ones(2)), OrderedDict(x=torch.zeros(3, dtype=torch.float16))],
        "plain": {"lr": 0.1, "betas": (0.9, 0.95), "name": "adam", "none": None},
    }


def _saved(tmp_path: Path, value=None, name: str = "x.pt") -> Path:
    path = tmp_path / name
    torch.save(_sample() if value is None else value, path)
    return path


@pytest.mark.parametrize("lazy_bytes", [0, 1 << 40])
def test_every_tensor_equals_torch_load(tmp_path, lazy_bytes):
    path = _saved(tmp_path)
    got = torch_zip.load_lazy(str(path), lazy_bytes=lazy_bytes)
    theirs = torch.load(path, weights_only=True)
    theirs["param"] = theirs["param"].detach()
    lazy = [k for k, v in got.items() if isinstance(v, LazyTensor)]
    assert (lazy == []) == (lazy_bytes > 1 << 30)
    if lazy_bytes == 0:  # contiguous tensors with a dimension are lazy; the transposed one was read at once
        assert set(lazy) == {"big", "view", "flat", "bf16", "mask", "ints", "param"}
    _same(got, theirs)


@pytest.mark.parametrize("lazy_bytes", [0, 1 << 40])
def test_a_dict_the_pickle_holds_twice_is_read_once(tmp_path, lazy_bytes):
    """Both places get the same tensors (the second visit once took the tensors the first had
    read for meta ones: "holds a torch.strided tensor; only dense tensors are read")."""
    shared = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    path = _saved(tmp_path, {"model": shared, "ema": shared, "step": 3})
    got = torch_zip.load_lazy(str(path), lazy_bytes=lazy_bytes)
    assert got["model"] is got["ema"] and got["step"] == 3
    for name, tensor in shared.items():
        assert torch.equal(materialize(got["model"][name]), tensor), name
    located = torch_zip.locate(str(path), str(tmp_path))
    assert located["model"]["w"] == torch_zip.StoredTensor((2, 3), torch.float32, located["model"]["w"].offset, 24)


def test_a_range_reads_only_its_bytes(tmp_path, bytes_read):
    path = _saved(tmp_path, {"w": torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)})
    read = bytes_read
    w = torch_zip.load_lazy(str(path))["w"]
    assert isinstance(w, LazyTensor) and read == []  # 4 MiB: nothing read until asked
    part = w.read(5000, 7000)
    assert torch.equal(part, torch.arange(5000, 7000, dtype=torch.float32)) and read == [8000]


def test_an_archive_at_a_byte_range_of_a_bigger_file(tmp_path):
    blob = _saved(tmp_path).read_bytes()
    packed = tmp_path / "packed.bin"
    packed.write_bytes(b"\0" * 4099 + blob + b"PK\x05\x06 trailing junk")
    src = torch_zip.open_archive(str(packed), str(tmp_path), 4099, len(blob))
    theirs = torch.load(tmp_path / "x.pt", weights_only=True)
    theirs["param"] = theirs["param"].detach()
    _same(torch_zip.load(src, lazy_bytes=0), theirs)
    with pytest.raises(CheckpointError, match="past its end"):
        torch_zip.open_archive(str(packed), str(tmp_path), 4099, len(blob) + 100)


def test_deepspeed_files_with_stand_ins_equal_the_whole_file_reader():
    """Every fixture .pt (DeepSpeed's loss scaler, stage enum, ...) reads as load_pt reads it."""
    from zeroshard.interop.torch_pickle import load_pt

    files = sorted(Path(__file__).parent.glob("data/deepspeed/**/*.pt"))
    assert len(files) > 20
    for path in files:
        mine, theirs = torch_zip.load_lazy(str(path), lazy_bytes=0), load_pt(str(path))
        _same(mine, theirs, str(path))


def test_legacy_format_is_read_whole(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(6.0)}, legacy, _use_new_zipfile_serialization=False)
    assert torch.equal(torch_zip.load_lazy(str(legacy))["w"], torch.arange(6.0))


def _zip64_copy(src: Path, dst: Path, monkeypatch) -> None:
    """The same records, stored, with zip64 fields everywhere (zipfile's limit lowered)."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 8)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))


def test_zip64_archives_read(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    _zip64_copy(path, tmp_path / "z64.pt", monkeypatch)
    raw = (tmp_path / "z64.pt").read_bytes()
    assert struct.pack("<I", 0x06064B50) in raw  # the zip64 end record is really there
    theirs = torch.load(path, weights_only=True)
    theirs["param"] = theirs["param"].detach()
    _same(torch_zip.load_lazy(str(tmp_path / "z64.pt"), lazy_bytes=0), theirs)


# ---- hostile archives ---------------------------------------------------------------------
def _central(raw: bytes, suffix: str) -> int:
    """Position of the central directory entry whose name ends with `suffix`."""
    pos = raw.rfind(b"PK\x05\x06")
    pos = struct.unpack("<I", raw[pos + 16: pos + 20])[0]
    while raw[pos: pos + 4] == b"PK\x01\x02":
        nlen, xlen, clen = struct.unpack("<HHH", raw[pos + 28: pos + 34])
        if raw[pos + 46: pos + 46 + nlen].decode().endswith(suffix):
            return pos
        pos += 46 + nlen + xlen + clen
    raise AssertionError(suffix)


def _patch(path: Path, suffix: str, field: int, fmt: str, value) -> None:
    raw = bytearray(path.read_bytes())
    at = _central(bytes(raw), suffix) + field
    raw[at: at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(raw))


def _refused(path: Path, *needles: str) -> None:
    with pytest.raises(CheckpointError) as err:
        torch_zip.load_lazy(str(path), lazy_bytes=0)
    message = str(err.value)
    assert path.name in message and "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def _two(tmp_path: Path) -> Path:
    return _saved(tmp_path, {"a": torch.arange(100.0), "b": torch.arange(200.0)})


def test_compressed_records_are_refused(tmp_path):
    path = _two(tmp_path)
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as z:
        for info in zin.infolist():
            z.writestr(info.filename, zin.read(info.filename))
    _refused(tmp_path / "deflated.pt", "compressed")


def test_absurd_record_size_is_refused(tmp_path):
    path = _two(tmp_path)
    for field in (20, 24):  # stored and real size
        _patch(path, "data/0", field, "<I", 0xFFFFFFF0)
    _refused(path, "data/0", "runs past")


def test_overlapping_records_are_refused(tmp_path):
    path = _two(tmp_path)
    for field in (20, 24):
        _patch(path, "data/0", field, "<I", 900)  # 400 real bytes: now reaches into data/1's header
    _refused(path, "overlap")


def test_storage_size_disagreeing_with_the_pickle_is_refused(tmp_path):
    path = _two(tmp_path)
    for field in (20, 24):
        _patch(path, "data/1", field, "<I", 796)
    _refused(path, "data/1", "796 bytes")


def test_duplicate_record_names_are_refused(tmp_path):
    path = _two(tmp_path)
    raw = path.read_bytes()
    name = next(n for n in zipfile.ZipFile(path).namelist() if n.endswith("data/1"))
    twin = name[:-1] + "0"
    raw = raw.replace(name.encode(), twin.encode())  # central and local header alike
    path.write_bytes(raw)
    _refused(path, "appears twice")


def test_truncated_or_garbage_files_are_refused(tmp_path):
    path = _two(tmp_path)
    path.write_bytes(path.read_bytes()[:-30])
    _refused(path)
    path.write_bytes(b"PK\x03\x04" + os.urandom(3000))
    _refused(path)


class _OutOfBounds:
    def __reduce__(self):
        storage = torch.arange(100.0).untyped_storage()
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True)
        return (torch._utils._rebuild_tensor_v2, (typed, 90, (5, 6), (6, 1), False, OrderedDict()))


def test_a_view_past_its_storage_is_refused(tmp_path):
    path = _saved(tmp_path, {"w": _OutOfBounds()})
    _refused(path, "reaches past its storage")


def test_hostile_global_is_refused_and_never_runs(tmp_path):
    side = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {side}",))

    path = _saved(tmp_path, {"w": torch.ones(3), "x": Evil()})
    _refused(path, "refused")
    assert not side.exists()


def test_big_non_contiguous_views_are_refused(tmp_path, monkeypatch):
    path = _saved(tmp_path, {"t": torch.ones(100, 100).t()})
    monkeypatch.setattr(torch_zip, "MAX_STRIDED_BYTES", 1000)
    _refused(path, "non-contiguous")


def test_deep_nesting_is_refused(tmp_path):
    nested: list = []
    for _ in range(150):
        nested = [nested]
    _refused(_saved(tmp_path, {"n": nested}), "nested deeper")


# ---- the same reader over S3 (moto, conftest): Source reads through storage's RangeReader ------------
def _put(s3_bucket: str, key: str, data: bytes) -> str:
    from zeroshard.storage import Location

    Location(s3_bucket).write_bytes(key, data)
    return f"{s3_bucket}/{key}"


@pytest.mark.s3
def test_an_archive_on_s3_reads_by_range_as_locally(tmp_path, s3_bucket):
    from zeroshard.storage import RangeReader

    blob = _saved(tmp_path).read_bytes()
    url = _put(s3_bucket, "packed.bin", b"\0" * 4099 + blob)
    src = torch_zip.open_archive(url, s3_bucket, 4099, len(blob))
    assert isinstance(src.reader, RangeReader) and not hasattr(src, "fd")  # no raw descriptor any more
    theirs = torch.load(tmp_path / "x.pt", weights_only=True)
    theirs["param"] = theirs["param"].detach()
    got = torch_zip.load(src, lazy_bytes=0)
    assert isinstance(got["big"], LazyTensor)  # read later, through ranged GETs
    _same(got, theirs)
    _same(torch_zip.load_lazy(_put(s3_bucket, "x.pt", blob), lazy_bytes=0), theirs)


@pytest.mark.s3
def test_hostile_or_cut_archives_on_s3_are_refused_naming_the_url(tmp_path, s3_bucket):
    raw = _two(tmp_path).read_bytes()
    name = next(n for n in zipfile.ZipFile(tmp_path / "x.pt").namelist() if n.endswith("data/1"))
    cases = {"twice.pt": (raw.replace(name.encode(), name[:-1].encode() + b"0"), "appears twice"),
             "cut.pt": (raw[:-30], ""), "garbage.pt": (b"PK\x03\x04" + os.urandom(3000), "")}
    for key, (data, needle) in cases.items():
        url = _put(s3_bucket, key, data)
        with pytest.raises(CheckpointError) as err:
            torch_zip.load_lazy(url, lazy_bytes=0)
        message = str(err.value)
        assert url in message and needle in message and "\n" not in message, message
    with pytest.raises(CheckpointError, match=f"{s3_bucket}/absent.pt"):
        torch_zip.load_lazy(f"{s3_bucket}/absent.pt")
