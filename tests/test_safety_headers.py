"""Hostile safetensors headers: each is a one-line error naming the file, in bounded time."""

import json
import struct
import time

import pytest
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.storage.safetensors_header import parse_header

TIER = "default"  # docs/TESTING.md


def header_file(path, header: bytes, data: bytes = b"", length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
CASES = {
    "duplicate name": (b'{"w": %s, "w": %s}' % (json.dumps(F32x2).encode(), json.dumps(F32x2).encode()), b"\0" * 8,
                       "names 'w' twice"),
    "not an object": (b"[1, 2, 3]", b"", "not a JSON object"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, b"", "nested absurdly deep"),
    "not json": (b"\xff\xfe{", b"", "not valid JSON"),
    "offsets past the end": (json.dumps({"w": {**F32x2, "data_offsets": [0, 8]}}).encode(), b"\0" * 4, "truncated"),
    "overlapping": (json.dumps({"a": F32x2, "b": {**F32x2, "data_offsets": [4, 12]}}).encode(), b"\0" * 12,
                    "overlap or gap"),
    "offsets not ints": (json.dumps({"w": {**F32x2, "data_offsets": [0.0, 8.0]}}).encode(), b"\0" * 8, "malformed"),
    "bool dims": (json.dumps({"w": {**F32x2, "shape": [True, 2]}}).encode(), b"\0" * 8, "malformed"),
    "absurd rank": (json.dumps({"w": {"dtype": "U8", "shape": [1] * 100_000, "data_offsets": [0, 1]}}).encode(), b"\0",
                    "malformed"),
    "dtype a list": (json.dumps({"w": {**F32x2, "dtype": ["F32"]}}).encode(), b"\0" * 8, "malformed"),
    "range vs shape": (json.dumps({"w": {**F32x2, "shape": [3]}}).encode(), b"\0" * 8, "does not match"),
    "metadata not strings": (json.dumps({"__metadata__": {"a": 1}}).encode(), b"", "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_header_is_a_one_line_error_naming_the_file(tmp_path, case):
    header, data, needle = CASES[case]
    header_file(tmp_path / "m.safetensors", header, data)
    started = time.monotonic()
    result = CliRunner().invoke(main, ["shard", "-q", str(tmp_path / "m.safetensors"), str(tmp_path / "out"),
                                       "--world", "2"])
    assert time.monotonic() - started < 10
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "m.safetensors" in result.output and needle in result.output, result.output
    assert len(result.output) < 500
    assert not (tmp_path / "out" / "zeroshard.json").exists()


def test_absurd_header_length_is_refused_before_reading(tmp_path):
    header_file(tmp_path / "m.safetensors", b"{}", length=1 << 62)
    result = CliRunner().invoke(main, ["shard", "-q", str(tmp_path / "m.safetensors"), str(tmp_path / "out"),
                                       "--world", "1"])
    assert result.exit_code == 1 and "absurd safetensors header length" in result.output


def test_a_long_tensor_name_is_quoted_short():
    name = "x" * 100_000
    raw = json.dumps({name: {**F32x2, "shape": [3]}}).encode()
    with pytest.raises(CheckpointError) as info:
        parse_header(raw, "f.safetensors")
    assert len(str(info.value)) < 300 and "f.safetensors" in str(info.value)


def test_a_good_header_still_parses():
    header = parse_header(json.dumps({"a": F32x2, "b": {**F32x2, "data_offsets": [8, 16]}}).encode(), "f", None)
    assert sorted(header.entries) == ["a", "b"] and header.file_size == header.data_start + 16
