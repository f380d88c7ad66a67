"""Bad input gets a one-line error naming the file and the problem, a non-zero exit, and nothing
that looks complete is left behind."""

import json
import resource
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroshard.cli import main

from checkpoints import odd_model, save_model, training_state, write_checkpoint

TIER = "default"  # docs/TESTING.md

RANK1 = "rank-00001-of-00003.safetensors"


def run_cli(*args):
    result = CliRunner().invoke(main, ["-h"] if not args else list(args), catch_exceptions=False)
    return result.exit_code, result.output


FORMAT_1_0 = Path(__file__).parent / "data" / "format-1.0"


@pytest.fixture(params=["1.1", "1.0"])
def ckpt(tmp_path, request):
    """The same 3-rank training checkpoint, written now (1.1) or by the 1.0 writer (shipped)."""
    if request.param == "1.0":
        shutil.copytree(FORMAT_1_0 / "training-w3", tmp_path / "ckpt")
    else:
        specs, data = training_state()
        write_checkpoint(str(tmp_path / "ckpt"), specs, data, 3, aliases={"lm_head.weight": "embed.weight"})
    return tmp_path / "ckpt"


def edit_manifest(ckpt: Path, change) -> None:
    doc = json.loads((ckpt / "zeroshard.json").read_text())
    change(doc)
    (ckpt / "zeroshard.json").write_text(json.dumps(doc))


def assert_one_line_error(code, output, *needles, exit_code=1):
    assert code == exit_code, output
    assert "Traceback" not in output
    for needle in needles:
        assert needle in output, output


ALL_READERS = [("verify",), ("consolidate", "{out}"), ("reshard", "--to", "2", "-o", "{out}")]


def run_reader(command, ckpt: Path):
    out = str(ckpt.parent / f"out-{command[0]}.safetensors")
    args = [a.format(out=out) for a in command]
    return (*run_cli(args[0], "-q", str(ckpt), *args[1:]), Path(out))


@pytest.mark.parametrize("command", ALL_READERS)
def test_missing_rank_file(ckpt, command):
    (ckpt / RANK1).unlink()
    code, output, out = run_reader(command, ckpt)
    assert_one_line_error(code, output, RANK1, exit_code=3 if command[0] == "verify" else 1)
    assert not out.exists() or command[0] == "reshard" and not (out / "zeroshard.json").exists()


@pytest.mark.parametrize("command", ALL_READERS)
def test_truncated_rank_file(ckpt, command):
    data = (ckpt / RANK1).read_bytes()
    (ckpt / RANK1).write_bytes(data[:-10])
    code, output, out = run_reader(command, ckpt)
    assert_one_line_error(code, output, RANK1, "truncated", exit_code=3 if command[0] == "verify" else 1)
    assert not out.exists() or command[0] == "reshard" and not (out / "zeroshard.json").exists()


def flip_byte_in(path: Path, tensor: str) -> None:
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + length])[tensor]["data_offsets"]
    data[8 + length + (begin + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("command", ALL_READERS)
def test_flipped_byte_is_a_hash_mismatch(ckpt, command):
    flip_byte_in(ckpt / RANK1, "embed.weight")
    code, output, out = run_reader(command, ckpt)
    assert_one_line_error(code, output, RANK1, "hash mismatch", exit_code=3 if command[0] == "verify" else 1)
    assert not out.exists() or command[0] == "reshard" and not (out / "zeroshard.json").exists()


def test_flipped_byte_in_weights_stops_consolidate(tmp_path):
    save_model(odd_model(), tmp_path / "m.safetensors")
    run_cli("shard", "-q", str(tmp_path / "m.safetensors"), str(tmp_path / "ckpt"), "--world", "2")
    path = tmp_path / "ckpt" / "rank-00000-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    code, output = run_cli("consolidate", "-q", str(tmp_path / "ckpt"), str(tmp_path / "o.safetensors"))
    assert_one_line_error(code, output, "rank-00000-of-00002.safetensors", "hash mismatch")
    assert not (tmp_path / "o.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".zeroshard-tmp")]


def test_extra_rank_file(ckpt):
    (ckpt / "rank-00003-of-00003.safetensors").write_bytes((ckpt / RANK1).read_bytes())
    code, output = run_cli("verify", "-q", str(ckpt))
    assert_one_line_error(code, output, "rank-00003-of-00003.safetensors", "extra rank file", exit_code=3)


LEGACY_FRAGMENT_EDITS = [  # 1.0 manifests list fragments; each must be what the layout implies
    (lambda d: d["tensors"]["embed.weight"]["fragments"].__setitem__(0, [0, 0, 10**9, "x"]), "out of range"),
    (lambda d: d["tensors"]["embed.weight"]["fragments"][1].__setitem__(1, 100), "overlap"),
    (lambda d: d["tensors"]["embed.weight"]["fragments"][1].__setitem__(1, 140), "not covered"),
    (lambda d: d["tensors"]["embed.weight"]["fragments"].pop(), "not covered"),
    (lambda d: d["tensors"]["embed.weight"]["fragments"].__setitem__(0, "x"), "must be an array"),
]
HOSTILE_EDITS = [  # wrong types, absurd sizes: one line naming the manifest, bounded time and memory
    (lambda d: d.__setitem__("world_size", 10**5), "one per rank"),
    (lambda d: d.__setitem__("world_size", 10**7), "out of range"),
    (lambda d: d.__setitem__("world_size", 10**12), "out of range"),
    (lambda d: d.__setitem__("world_size", "3"), "world_size must be an integer"),
    (lambda d: d["tensors"]["embed.weight"].__setitem__("dtype", ["F32"]), "dtype must be a string"),
    (lambda d: d.__setitem__("optimizer", "adam"), "optimizer must be an object"),
    (lambda d: d["optimizer"].__setitem__("param_groups", {"a": 1}), "param_groups must be an array"),
    (lambda d: d.__setitem__("zero_stage", "3"), "zero_stage must be an integer"),
    (lambda d: d.__setitem__("zero_stage", 7), "zero_stage 7 is out of range"),
    (lambda d: d.__setitem__("tensors", []), "tensors must be an object"),
    (lambda d: d["files"].__setitem__(0, "rank-00000-of-00003.safetensors"), "files[0] must be an object"),
    (lambda d: d["files"][0].__setitem__("size", -5), "out of range"),
    (lambda d: d["tensors"]["embed.weight"].__setitem__("shape", [10**9, 10**9]),
     ("rank files hold only", "not covered")),
    (lambda d: d["tensors"]["embed.weight"].__setitem__("shape", "37x11"), "shape must be an array"),
    (lambda d: d.__setitem__("aliases", {"x": ["embed.weight"]}), "must be a string"),
    (lambda d: d.__setitem__("step", 1.5), "step must be an integer"),
    (lambda d: d.__setitem__("id", {"a": 1}), "id must be a string"),
    (lambda d: d.pop("files"), "'files' is missing"),
]


@pytest.mark.parametrize("change,needle", HOSTILE_EDITS)
def test_hostile_manifest_fields(ckpt, change, needle):
    edit_manifest(ckpt, change)
    code, output = run_cli("inspect", str(ckpt))
    assert_one_line_error(code, output, "zeroshard.json")
    assert any(n in output for n in ((needle,) if isinstance(needle, str) else needle)), output


def test_local_owner_outside_the_world(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ckpt"), specs, data, 3)
    edit_manifest(tmp_path / "ckpt", lambda d: d["tensors"]["rng/rank-00002/cpu"].__setitem__("owner", 9))
    code, output = run_cli("inspect", str(tmp_path / "ckpt"))
    assert_one_line_error(code, output, "zeroshard.json", "owner", "out of range")


def test_legacy_fragment_lists_are_checked(tmp_path):
    for change, needle in LEGACY_FRAGMENT_EDITS:
        shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
        shutil.copytree(FORMAT_1_0 / "training-w3", tmp_path / "ckpt")
        edit_manifest(tmp_path / "ckpt", change)
        for command in ("verify", "inspect"):
            code, output = run_cli(command, str(tmp_path / "ckpt"))
            assert code in (1, 3) and needle in output and "zeroshard.json" in output, (command, output)


def test_deeply_nested_or_huge_manifest(ckpt):
    text = (ckpt / "zeroshard.json").read_text()
    (ckpt / "zeroshard.json").write_text(text.replace('"client_state": ',
                                                      '"client_state": ' + "[" * 100_000 + "]" * 100_000 + ', "x": '))
    code, output = run_cli("inspect", str(ckpt))
    assert_one_line_error(code, output, "zeroshard.json", "nested too deeply")
    (ckpt / "zeroshard.json").write_text(text.replace('"version": ', '"version": ' + "1" * 10_000_000 + ', "v": '))
    code, output = run_cli("inspect", str(ckpt))
    assert_one_line_error(code, output, "zeroshard.json")
    assert len(output) < 1000


@pytest.mark.parametrize("change,needle", [
    (lambda d: d.__setitem__("version", "2.0"), "not supported"),
    (lambda d: d["files"][1].__setitem__("name", "../../etc/passwd"), "escapes"),
    (lambda d: d["files"][1].__setitem__("name", "/abs/rank.safetensors"), "escapes"),
    (lambda d: d["files"].pop(), "one per rank"),
    (lambda d: d.__setitem__("world_size", 5), "one per rank"),
    (lambda d: d["tensors"]["embed.weight"].__setitem__("dtype", "F16"), "F16"),
    (lambda d: d["tensors"]["embed.weight"].__setitem__("shape", [38, 11]), "embed.weight"),
    (lambda d: d.__setitem__("format", "something-else"), "not a zeroshard manifest"),
    (lambda d: d["tensors"]["embed.weight"].__setitem__("dtype", "Q4"), "unknown dtype"),
])
def test_bad_manifest(ckpt, change, needle):
    edit_manifest(ckpt, change)
    for command in ("verify", "inspect", "consolidate"):
        args = [command, str(ckpt)] + ([str(ckpt.parent / "o.safetensors")] if command == "consolidate" else [])
        code, output = run_cli(*args)
        if command == "inspect" and code == 0:
            continue  # inspect reads the manifest only: a dtype/shape disagreement with a header is not its business
        assert code in (1, 3), (command, output)
        assert "Traceback" not in output and needle in output, (command, output)
        assert "zeroshard.json" in output or ".safetensors" in output, output
    assert not (ckpt.parent / "o.safetensors").exists()


def test_manifest_not_json_or_duplicate_keys(ckpt):
    text = (ckpt / "zeroshard.json").read_text()
    (ckpt / "zeroshard.json").write_text(text.replace('"world_size": 3,', '"world_size": 3, "world_size": 3,'))
    code, output = run_cli("inspect", str(ckpt))
    assert_one_line_error(code, output, "zeroshard.json", "duplicate key")
    (ckpt / "zeroshard.json").write_text(text[:100])
    code, output = run_cli("inspect", str(ckpt))
    assert_one_line_error(code, output, "zeroshard.json", "not valid JSON")


def test_absurd_header_length(ckpt):
    data = (ckpt / RANK1).read_bytes()
    (ckpt / RANK1).write_bytes(struct.pack("<Q", 2**62) + data[8:])
    code, output = run_cli("verify", str(ckpt))
    assert_one_line_error(code, output, RANK1, "absurd safetensors header length", exit_code=3)


def test_header_from_another_save(ckpt, tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "other"), specs, data, 3)
    (ckpt / RANK1).write_bytes((tmp_path / "other" / RANK1).read_bytes())
    code, output = run_cli("consolidate", str(ckpt), str(tmp_path / "o.safetensors"))
    assert code == 1 and RANK1 in output and ("another save" in output or "records" in output), output


def test_incomplete_checkpoint_and_bad_latest(ckpt, tmp_path):
    (ckpt / "zeroshard.json").unlink()
    code, output = run_cli("inspect", str(ckpt))
    assert_one_line_error(code, output, "incomplete checkpoint", "never committed")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "latest").write_text("../ckpt\n")
    code, output = run_cli("inspect", str(tmp_path / "root"))
    assert_one_line_error(code, output, "latest", "not a folder inside")
    code, output = run_cli("inspect", str(tmp_path / "nowhere"))
    assert_one_line_error(code, output, "nowhere", "does not exist")


def test_existing_output_is_refused_unless_overwrite(ckpt, tmp_path):
    target = tmp_path / "o.safetensors"
    target.write_bytes(b"precious")
    code, output = run_cli("consolidate", "-q", str(ckpt), str(target))
    assert_one_line_error(code, output, "already exists", "--overwrite")
    assert target.read_bytes() == b"precious"
    code, output = run_cli("consolidate", "-q", "--overwrite", str(ckpt), str(target))
    assert code == 0, output
    code, output = run_cli("reshard", "-q", str(ckpt), "--to", "2", "-o", str(ckpt))
    assert code == 1 and "differ" in output
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    code, output = run_cli("reshard", "-q", str(ckpt), "--to", "2", "-o", str(tmp_path / "taken"))
    assert_one_line_error(code, output, "already exists")


def _cli_with_file_size_limit(limit: int, *args) -> subprocess.CompletedProcess:
    """Run the CLI where writes beyond `limit` bytes fail (EFBIG), as on a full disk."""
    def limit_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return subprocess.run([sys.executable, "-m", "zeroshard.cli", *args], capture_output=True, text=True,
                          preexec_fn=limit_writes, timeout=120)


def test_output_failing_half_way_leaves_nothing_complete(tmp_path):
    model = {f"w{i}": __import__("torch").randn(256, 256) for i in range(4)}  # 1 MiB
    save_model(model, tmp_path / "m.safetensors")
    assert run_cli("shard", "-q", str(tmp_path / "m.safetensors"), str(tmp_path / "ckpt"), "--world", "2")[0] == 0
    result = _cli_with_file_size_limit(300_000, "consolidate", "-q", str(tmp_path / "ckpt"),
                                       str(tmp_path / "o.safetensors"))
    assert result.returncode == 1, result.stderr
    assert "o.safetensors" in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m.safetensors"]
    result = _cli_with_file_size_limit(300_000, "reshard", "-q", str(tmp_path / "ckpt"), "--to", "1", "-o",
                                       str(tmp_path / "r1"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "r1" / "zeroshard.json").exists()
    assert not [p for p in (tmp_path / "r1").iterdir() if p.name.startswith("rank-")]  # temp files were removed
    # the input is untouched and still verifies
    assert run_cli("verify", "-q", str(tmp_path / "ckpt"))[0] == 0


def test_help_teaches(tmp_path):
    code, output = run_cli("--help")
    assert code == 0 and "reshard" in output and "s3://" in output
    for command in ("shard", "consolidate", "reshard", "inspect", "verify"):
        code, output = run_cli(command, "--help")
        assert code == 0 and "--storage-option" in output and "--quiet" in output, command


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command,victim", [*((c, v) for c in ALL_READERS for v in (RANK1, "zeroshard.json")),
                                            (("inspect",), "zeroshard.json")])  # inspect reads no rank file
def test_fifo_in_place_of_a_file_is_refused_without_hanging(ckpt, command, victim):
    """Opening a FIFO for reading blocks until a writer comes: a checkpoint file that is one
    must be an error, not a command that never returns."""
    import os

    (ckpt / victim).unlink()
    os.mkfifo(ckpt / victim)
    code, output, out = run_reader(command, ckpt)
    assert code in (1, 3) and "Traceback" not in output and victim in output, output
    # a size check may see it first ("0 bytes"); otherwise opening it says what it is
    assert "not a regular file (a FIFO)" in output or "truncated: 0 bytes" in output, output
    assert not out.exists() or command[0] == "reshard" and not (out / "zeroshard.json").exists()


def strip_hash_table(path: Path) -> bytes:
    """The rank file at `path` with its fragment hash table taken out of header and data, as a
    file whose header is otherwise well formed."""
    from zeroshard.format.manifest import HASH_TABLE_NAME

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    table = header.pop(HASH_TABLE_NAME)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + length:8 + length + table["data_offsets"][0]]


def rerecord(ckpt: Path, rank: int, data: bytes) -> None:
    """Write a rank file and record its new size and hash, as a careful forger would."""
    from zeroshard.storage.hashing import hash_bytes

    (ckpt / f"rank-{rank:05d}-of-00003.safetensors").write_bytes(data)

    def change(doc):
        entry = next(f for f in doc["files"] if f["rank"] == rank)
        entry["size"], entry["hash"] = len(data), hash_bytes(data)
    edit_manifest(ckpt, change)


@pytest.mark.parametrize("command", ALL_READERS)
def test_rank_file_without_its_hash_table(tmp_path, command):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "ckpt"), specs, data, 3)
    rerecord(tmp_path / "ckpt", 1, strip_hash_table(tmp_path / "ckpt" / RANK1))
    code, output, _ = run_reader(command, tmp_path / "ckpt")
    assert_one_line_error(code, output, f"{RANK1}: no fragment hash table", "manifest says format 1.1",
                          exit_code=3 if command[0] == "verify" else 1)
    assert "'None'" not in output and "rank-00000" not in output and "rank-00002" not in output


def legacy_manifest_as_1_1(ckpt: Path) -> None:
    """Relabel a 1.0 manifest as 1.1, converting its fields so that it parses as one."""
    def change(doc):
        doc["version"] = "1.1"
        for t in doc["tensors"].values():
            fragments = t.pop("fragments")
            if t["layout"] == "local":
                t["owner"] = fragments[0][0]
    edit_manifest(ckpt, change)


@pytest.mark.parametrize("deep", [False, True])
def test_1_0_checkpoint_whose_manifest_says_1_1(tmp_path, deep):
    shutil.copytree(FORMAT_1_0 / "training-w3", tmp_path / "ckpt")
    legacy_manifest_as_1_1(tmp_path / "ckpt")
    code, output = run_cli("verify", "-q", *(["--deep"] if deep else []), str(tmp_path / "ckpt"))
    assert_one_line_error(code, output, "no fragment hash table", "written by format 1.0",
                          "manifest says format 1.1", exit_code=3)
    lines = [line for line in output.splitlines() if "rank-0000" in line]
    assert len(lines) == 3 and "'None'" not in output, output  # one line per file, each naming it
    for rank in range(3):
        assert f"rank-0000{rank}-of-00003.safetensors: no fragment hash table" in output
    code, output = run_cli("consolidate", "-q", str(tmp_path / "ckpt"), str(tmp_path / "o.safetensors"))
    assert_one_line_error(code, output, "rank-00000-of-00003.safetensors: no fragment hash table",
                          "manifest says format 1.1")


def test_1_1_rank_file_in_a_1_0_checkpoint(tmp_path):
    shutil.copytree(FORMAT_1_0 / "training-w3", tmp_path / "ckpt")
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "new"), specs, data, 3)
    rerecord(tmp_path / "ckpt", 1, (tmp_path / "new" / RANK1).read_bytes())
    code, output = run_cli("verify", "-q", str(tmp_path / "ckpt"))
    assert_one_line_error(code, output, f"{RANK1}: has a fragment hash table", "manifest says format 1.0",
                          exit_code=3)
    assert "is in the file but not in the manifest" not in output, output


def test_hf_folder_whose_index_and_files_disagree(tmp_path):
    """A tensor in a shard file that the index maps elsewhere or not at all would be loaded by
    transformers: `shard` refuses the folder, naming the file and the tensor, rather than drop it."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    model = odd_model()
    names = sorted(model)
    save_file({n: model[n] for n in names[:2]}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({n: model[n] for n in names[2:]}, str(hf / "model-00002-of-00002.safetensors"))
    weight_map = {n: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    for index, needle in (({k: v for k, v in weight_map.items() if k != names[-1]}, "does not name"),
                          (dict(weight_map, **{names[-1]: "model-00001-of-00002.safetensors"}), "maps to")):
        (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        code, output = run_cli("shard", str(hf), str(tmp_path / "out"), "--world", "2")
        assert_one_line_error(code, output, "model-00002-of-00002.safetensors", repr(names[-1]), needle)
        assert not (tmp_path / "out").exists()
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    code, output = run_cli("shard", str(hf), str(tmp_path / "out"), "--world", "2")
    assert code == 0, output
