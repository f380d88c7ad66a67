"""Many ranks and parallel workers: the rank-major paths give the same bytes with 1 or N
processes, at hundreds of ranks, and a failure in any worker leaves nothing behind."""

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from zeroshard.errors import CheckpointError
from zeroshard.toolkit.consolidate import consolidate
from zeroshard.toolkit.reshard import reshard
from zeroshard.toolkit.shard import shard
from zeroshard.toolkit.verify import verify

from checkpoints import read_checkpoint, training_state, write_checkpoint
from test_bad_input import flip_byte_in
from test_roundtrip import assert_same

TIER = "slow"  # docs/TESTING.md


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob(".zeroshard-tmp-*")]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """40 tensors of odd sizes (some smaller than the world) over 300 ranks."""
    root = tmp_path_factory.mktemp("wide")
    g = torch.Generator().manual_seed(3)
    model = {f"t{i}": torch.randn(1 + 37 * i, generator=g) for i in range(40)}
    model["half"] = torch.randn(513, generator=g).half()
    save_file(model, str(root / "m.safetensors"))
    shard(str(root / "m.safetensors"), str(root / "w300"), 300)
    return root, model


@pytest.mark.parametrize("to", [1, 7, 299, 512])
def test_reshard_many_ranks_with_workers_is_exact(wide, tmp_path, to):
    root, model = wide
    reshard(str(root / "w300"), to, str(tmp_path / "one"))
    reshard(str(root / "w300"), to, str(tmp_path / "two"), workers=2)
    assert verify(str(tmp_path / "two"), workers=2).ok
    one, two = read_checkpoint(str(tmp_path / "one")), read_checkpoint(str(tmp_path / "two"))
    assert_same(one, two)
    assert_same(model, {k: v for k, v in two.items()})
    assert not leftovers(tmp_path)


def test_consolidate_with_workers_is_bit_identical(wide, tmp_path):
    root, model = wide
    consolidate(str(root / "w300"), str(tmp_path / "a.safetensors"))
    consolidate(str(root / "w300"), str(tmp_path / "b.safetensors"), workers=3)
    consolidate(str(root / "w300"), str(tmp_path / "hf"), max_shard_size="2KB", workers=2)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert_same(model, load_file(tmp_path / "a.safetensors"))
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 3
    merged = {k: v for f in shards for k, v in load_file(f).items()}
    assert_same(model, merged)
    assert not leftovers(tmp_path)


def test_corrupt_input_fails_every_worker_cleanly(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 6)
    victim = tmp_path / "c" / "rank-00004-of-00006.safetensors"
    flip_byte_in(victim, "embed.weight")
    for workers in (1, 2):
        with pytest.raises(CheckpointError, match="rank-00004-of-00006.safetensors"):
            reshard(str(tmp_path / "c"), 5, str(tmp_path / f"r{workers}"), workers=workers)
        assert not (tmp_path / f"r{workers}" / "zeroshard.json").exists()
        with pytest.raises(CheckpointError, match="rank-00004-of-00006.safetensors"):
            consolidate(str(tmp_path / "c"), str(tmp_path / f"m{workers}.safetensors"), workers=workers)
        assert not (tmp_path / f"m{workers}.safetensors").exists()
        report = verify(str(tmp_path / "c"), workers=workers)
        assert len(report.problems) >= 1 and "rank-00004-of-00006.safetensors" in report.problems[0]
    assert not leftovers(tmp_path)


def test_dtype_cast_on_the_rank_major_path(wide, tmp_path):
    root, model = wide
    consolidate(str(root / "w300"), str(tmp_path / "bf.safetensors"), dtype="bf16", workers=2)
    out = load_file(tmp_path / "bf.safetensors")
    assert_same({k: v.bfloat16() for k, v in model.items()}, out)


def test_big_fragments_stream_through_windows(tmp_path, monkeypatch):
    """Fragments larger than the read window are copied and hash-checked window by window."""
    import zeroshard.toolkit.gather as gather
    import zeroshard.toolkit.transfer as transfer

    monkeypatch.setattr(transfer, "WINDOW_BYTES", 4096)
    monkeypatch.setattr(gather, "WHOLE_HASH_BYTES", 0)  # no input is read whole
    model = {"big": torch.randn(10_000), "small": torch.arange(5, dtype=torch.int64)}
    save_file(model, str(tmp_path / "m.safetensors"))
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "w2"), 2)
    reshard(str(tmp_path / "w2"), 3, str(tmp_path / "w3"))
    consolidate(str(tmp_path / "w3"), str(tmp_path / "o.safetensors"))
    assert_same(model, load_file(tmp_path / "o.safetensors"))
    assert verify(str(tmp_path / "w3")).ok


def torchrun(*args, nproc=2):
    import subprocess
    import sys

    from distributed import free_port

    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           f"--master-port={free_port()}", "-m", "zeroshard.toolkit", *args],
                          capture_output=True, text=True, timeout=180, env=env)


def test_distributed_reshard_and_consolidate_under_torchrun(wide, tmp_path):
    root, model = wide
    result = torchrun("reshard", str(root / "w300"), "--to", "64", "-o", str(tmp_path / "w64"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert verify(str(tmp_path / "w64")).ok
    assert_same(model, read_checkpoint(str(tmp_path / "w64")))
    with ThreadPoolExecutor(2) as launches:  # two outputs of one input, side by side (CI time)
        one = launches.submit(torchrun, "consolidate", str(tmp_path / "w64"), str(tmp_path / "m.safetensors"),
                              "-j", "2")
        hf = launches.submit(torchrun, "consolidate", str(tmp_path / "w64"), str(tmp_path / "hf"),
                             "--max-shard-size", "3KB")
        consolidate(str(root / "w300"), str(tmp_path / "ref.safetensors"))
        one, hf = one.result(), hf.result()
    assert one.returncode == 0, one.stderr[-2000:]
    assert (tmp_path / "m.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert hf.returncode == 0, hf.stderr[-2000:]
    assert_same(model, {k: v for f in (tmp_path / "hf").glob("model-*.safetensors") for k, v in load_file(f).items()})
    assert not leftovers(tmp_path)


def test_distributed_failure_commits_nothing(tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 4)
    flip_byte_in(tmp_path / "c" / "rank-00003-of-00004.safetensors", "embed.weight")
    result = torchrun("reshard", str(tmp_path / "c"), "--to", "3", "-o", str(tmp_path / "r"))
    assert result.returncode != 0
    assert "rank-00003-of-00004.safetensors" in result.stderr and "hash mismatch" in result.stderr
    assert not (tmp_path / "r" / "zeroshard.json").exists() and not leftovers(tmp_path)


def test_resident_memory_stays_at_a_window_whatever_the_outputs(tmp_path):
    """Pages of inputs and of every output are dropped as a process-wide budget fills: a reshard
    into 16 outputs stays near one budget, not near the data size (here 4 MiB, windows of 1 MiB)."""
    import subprocess
    import sys

    import numpy as np
    from safetensors.numpy import save_file as save_numpy

    save_numpy({f"w{i}": np.random.default_rng(i).standard_normal(2_000_000, dtype=np.float32) for i in range(8)},
               str(tmp_path / "m.safetensors"))  # 64 MB
    shard(str(tmp_path / "m.safetensors"), str(tmp_path / "w2"), 2)
    script = (
        "import resource, sys\n"
        "import zeroshard.storage.mapped_file as m, zeroshard.toolkit.transfer as t\n"
        "m.RELEASE_EVERY_BYTES, t.WINDOW_BYTES = 4 << 20, 1 << 20\n"
        "from zeroshard.toolkit.reshard import reshard\n"
        "from zeroshard.toolkit.consolidate import consolidate\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "reshard(sys.argv[1], 16, sys.argv[2])\n"
        "consolidate(sys.argv[2], sys.argv[3])\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "w2"), str(tmp_path / "w16"),
                             str(tmp_path / "o.safetensors")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    grown_mib = int(result.stdout.split()[-1])
    assert grown_mib < 24, f"peak RSS grew by {grown_mib} MiB for 64 MB of data"
    assert load_file(tmp_path / "o.safetensors")["w3"].numel() == 2_000_000


# ---- many small files: the packed path (zeroshard/toolkit/packed.py) --------------------------
import json  # noqa: E402
import signal  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from click.testing import CliRunner  # noqa: E402

import zeroshard.toolkit.packed as packed  # noqa: E402
from zeroshard.cli import main  # noqa: E402
from zeroshard.errors import ZeroshardError  # noqa: E402
from zeroshard.format import open_checkpoint  # noqa: E402
from zeroshard.format.layouts import layouts_of  # noqa: E402
from zeroshard.format.reader import expected_header  # noqa: E402

FORMAT_1_0 = Path(__file__).parent / "data" / "format-1.0"


@pytest.fixture
def packed_tasks(monkeypatch):
    """The number of tasks the packed path completed in this process (it must not be skipped
    silently: then these tests would test the general path twice)."""
    done = []
    real = packed.run_packed

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        if result is not None:
            done.append(len(result))
        return result

    monkeypatch.setattr(packed, "run_packed", spy)
    return done


def rank_files_modulo_id(folder: Path) -> dict[str, bytes]:
    """Every rank file's bytes, with the checkpoint id (random per save) blanked out."""
    manifest = json.loads((folder / "zeroshard.json").read_text())
    return {f["name"]: (folder / f["name"]).read_bytes().replace(manifest["id"].encode(), b"-" * 32)
            for f in manifest["files"]}


def reshard_both_ways(source: Path, to: int, tmp_path: Path, monkeypatch, packed_tasks) -> tuple[Path, Path]:
    reshard(str(source), to, str(tmp_path / "packed"))
    assert packed_tasks, "the packed path was not taken"
    with monkeypatch.context() as m:
        m.setattr(packed, "PACK_MIN_FILES", 10**9)
        count = len(packed_tasks)
        reshard(str(source), to, str(tmp_path / "general"))
        assert len(packed_tasks) == count
    return tmp_path / "packed", tmp_path / "general"


@pytest.mark.parametrize("to", [1, 7, 299, 512])
def test_packed_path_writes_the_general_paths_bytes(wide, tmp_path, monkeypatch, packed_tasks, to):
    """Odd sizes, tensors smaller than the world, fp16 beside fp32 (unaligned offsets): the
    packed path's rank files are byte for byte the general path's, hash tables included."""
    root, model = wide
    a, b = reshard_both_ways(root / "w300", to, tmp_path, monkeypatch, packed_tasks)
    assert rank_files_modulo_id(a) == rank_files_modulo_id(b)
    assert verify(str(a), deep=True).ok
    assert_same(model, read_checkpoint(str(a)))
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("to", [64, 70])
def test_packed_path_carries_whole_and_local_tensors(tmp_path, monkeypatch, packed_tasks, to):
    """Optimizer state, 'whole' tensors (rank 0's) and per-rank RNG ('local': kept at the same
    world size, dropped at another)."""
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 70)
    a, b = reshard_both_ways(tmp_path / "c", to, tmp_path, monkeypatch, packed_tasks)
    assert rank_files_modulo_id(a) == rank_files_modulo_id(b)
    state = read_checkpoint(str(a))
    assert_same(data, {k: v for k, v in state.items() if not k.startswith("rng/")})
    assert len([k for k in state if k.startswith("rng/")]) == (70 if to == 70 else 0)
    assert verify(str(a), deep=True).ok


def test_packed_path_reads_format_1_0(tmp_path, monkeypatch, packed_tasks):
    monkeypatch.setattr(packed, "PACK_MIN_FILES", 0)
    a, b = reshard_both_ways(FORMAT_1_0 / "training-w3", 5, tmp_path, monkeypatch, packed_tasks)
    assert rank_files_modulo_id(a) == rank_files_modulo_id(b)
    assert json.loads((a / "zeroshard.json").read_text())["version"] == "1.1"
    original = read_checkpoint(str(FORMAT_1_0 / "training-w3"))
    assert_same({k: v for k, v in original.items() if not k.startswith("rng/")}, read_checkpoint(str(a)))


def test_rank_layouts_give_every_header_the_writer_wrote(wide, tmp_path):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 70)
    for folder in (wide[0] / "w300", tmp_path / "c", FORMAT_1_0 / "training-w3", FORMAT_1_0 / "odd-w4"):
        _, manifest = open_checkpoint(str(folder))
        layouts = layouts_of(manifest)
        if manifest.world_size > 8:  # runs of ranks share a layout, per-rank RNG states aside
            assert len(layouts.runs) <= 2 * len(manifest.tensors) + 3
            assert len(layouts.runs) < manifest.world_size // 2
        for file in manifest.files:
            raw, header = expected_header(file, manifest)
            assert layouts.header(file.rank) == raw == (folder / file.name).read_bytes()[:len(raw)]
            assert layouts.header_length(file.rank) == len(raw)  # the plans' shortcut: no header composed
            assert layouts.file_size(file.rank) == file.size
            assert layouts.expected(file.rank) == (raw, header)


def test_reading_every_rank_file_composes_each_layout_once(wide, tmp_path, monkeypatch):
    """Consolidating 300 ranks opens 300 files; their expected headers come from the runs of
    alike ranks (a handful), not from a walk over every file's tensors."""
    import zeroshard.format.layouts as layouts_module
    import zeroshard.format.reader as reader_module

    calls = {"reader": 0, "layouts": 0}

    def counting(key, function):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(reader_module, "rank_contents", counting("reader", reader_module.rank_contents))
    monkeypatch.setattr(layouts_module, "rank_contents", counting("layouts", layouts_module.rank_contents))
    consolidate(str(wide[0] / "w300"), str(tmp_path / "m.safetensors"))
    assert calls["reader"] == 0
    assert 0 < calls["layouts"] <= 2 * 41 + 3  # at most one per run, whatever the world size


def _header_span(path: Path) -> tuple[int, int]:
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8, 8 + length


def corrupt(path: Path, where: str) -> None:
    data = bytearray(path.read_bytes())
    start, end = _header_span(path)
    header = json.loads(data[start:end])
    if where == "fragment":
        begin, stop = header["embed.weight"]["data_offsets"]
        data[end + (begin + stop) // 2] ^= 0x40
    elif where == "hash table":
        begin, _ = header["__zeroshard_fragment_hashes__"]["data_offsets"]
        data[end + begin + 3] ^= 0x01
    elif where == "dropped local tensor":
        begin, stop = next(v["data_offsets"] for k, v in header.items() if k.startswith("rng/"))
        data[end + begin] ^= 0x01
    elif where == "header":  # still valid JSON, another checkpoint id
        at = data.index(header["__metadata__"]["checkpoint_id"].encode(), start)
        data[at] = ord("0") if data[at] != ord("0") else ord("1")
    elif where == "header padding":  # still valid JSON meaning the same: only the file hash sees it
        assert data[end - 1] == ord(" ")
        data[end - 1] = ord("\t")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["fragment", "hash table", "header", "header padding", "dropped local tensor"])
def test_any_changed_byte_is_found_by_every_command(tmp_path, packed_tasks, where):
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 70)
    folder = tmp_path / "c"
    victims = sorted(folder.glob("rank-*.safetensors"))
    if where == "header padding":
        victims = [p for p in victims if p.read_bytes()[_header_span(p)[1] - 1] == ord(" ")]
    victim = victims[min(5, len(victims) - 1)]
    corrupt(victim, where)
    with pytest.raises(ZeroshardError, match=victim.name):
        reshard(str(folder), 64, str(tmp_path / "r"))
    assert not (tmp_path / "r" / "zeroshard.json").exists()
    with pytest.raises(ZeroshardError, match=victim.name):
        consolidate(str(folder), str(tmp_path / "m.safetensors"))
    assert not (tmp_path / "m.safetensors").exists()
    for deep in (False, True):
        report = verify(str(folder), deep=deep)
        assert report.problems and all(victim.name in p for p in report.problems), report.problems
    assert not leftovers(tmp_path)


def test_deep_verify_checks_the_fragment_table_itself(tmp_path):
    """A table that disagrees with its fragments in a file that matches the manifest (a writer's
    bug, not storage): the whole-file check cannot see it, --deep does, naming the tensor."""
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 4)
    victim = tmp_path / "c" / "rank-00001-of-00004.safetensors"
    corrupt(victim, "hash table")
    manifest_path = tmp_path / "c" / "zeroshard.json"
    manifest = json.loads(manifest_path.read_text())
    from zeroshard.storage.hashing import hash_bytes

    next(f for f in manifest["files"] if f["name"] == victim.name)["hash"] = hash_bytes(victim.read_bytes())
    manifest_path.write_text(json.dumps(manifest))
    assert verify(str(tmp_path / "c")).ok
    report = verify(str(tmp_path / "c"), deep=True)
    assert len(report.problems) == 1 and victim.name in report.problems[0] and "tensor" in report.problems[0]
    result = CliRunner().invoke(main, ["verify", "-q", "--deep", str(tmp_path / "c")])
    assert result.exit_code == 3 and victim.name in result.output


def test_a_big_local_file_is_hashed_once_and_a_changed_byte_still_names_its_tensor(tmp_path, monkeypatch):
    """Files streamed in chunks (here: every file, as if over 16 MiB): without --deep each byte is
    hashed once (the whole-file hash), with --deep twice (and every fragment's too); a changed
    byte is still reported with the tensor it is in, by a second read of that file only."""
    import zeroshard.storage.hashing as hashing
    import zeroshard.toolkit.verify as verify_module

    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 2)
    monkeypatch.setattr(verify_module, "SMALL_FILE_BYTES", 0)
    hashed = []
    new_hasher = hashing.new_hasher

    class Counting:
        def __init__(self):
            self.inner = new_hasher()

        def update(self, data):
            hashed.append(len(memoryview(data).cast("B")))
            self.inner.update(data)

        def hexdigest(self):
            return self.inner.hexdigest()

    monkeypatch.setattr(hashing, "new_hasher", Counting)
    total = sum(p.stat().st_size for p in (tmp_path / "c").glob("rank-*"))
    assert verify(str(tmp_path / "c")).ok and sum(hashed) == total
    hashed.clear()
    assert verify(str(tmp_path / "c"), deep=True).ok and sum(hashed) > 1.5 * total
    victim = tmp_path / "c" / "rank-00001-of-00002.safetensors"
    flip_byte_in(victim, "embed.weight")
    for deep in (False, True):
        problems = verify(str(tmp_path / "c"), deep=deep).problems
        assert problems and all(victim.name in p for p in problems)
        assert any("tensor 'embed.weight': content hash mismatch" in p for p in problems), problems


KILLED_IN_PACKED_PATH = (
    "import os, signal, sys\n"
    "import zeroshard.storage.location as packed  # packed.py reads through Location.read_whole_into\n"
    "real = packed.read_regular_file\n"
    "seen = []\n"
    "def dying(path, into):\n"
    "    seen.append(path)\n"
    "    if len(seen) > 20: os.kill(os.getpid(), signal.SIGKILL)\n"
    "    return real(path, into)\n"
    "packed.read_regular_file = dying\n"
    "from zeroshard.cli import main\n"
    "sys.argv = ['zeroshard'] + sys.argv[1:]\n"
    "main()\n")


def test_a_writer_killed_in_the_packed_path_leaves_the_old_output(tmp_path):
    from test_safety_outputs import snapshot

    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 70)
    out = tmp_path / "out"
    reshard(str(tmp_path / "c"), 64, str(out), workers=1)
    before = snapshot(out)
    result = subprocess.run([sys.executable, "-c", KILLED_IN_PACKED_PATH, "reshard", "-q", "-j", "1", "--overwrite",
                             str(tmp_path / "c"), "--to", "64", "-o", str(out)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(".zeroshard-")} == before
    assert verify(str(out)).ok
    reshard(str(tmp_path / "c"), 64, str(out), overwrite=True)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".zeroshard-")]


def test_bigger_inputs_are_checked_by_the_fragments_used(tmp_path, monkeypatch):
    """Over WHOLE_HASH_BYTES an input is checked by the hashes of the fragments
    read (consolidate does not read the optimizer state beside the weights): still found."""
    import zeroshard.toolkit.gather as gather

    monkeypatch.setattr(gather, "WHOLE_HASH_BYTES", 0)
    specs, data = training_state()
    write_checkpoint(str(tmp_path / "c"), specs, data, 6)
    consolidate(str(tmp_path / "c"), str(tmp_path / "ok.safetensors"))
    assert_same({k: v for k, v in data.items() if "/" not in k}, load_file(tmp_path / "ok.safetensors"))
    victim = tmp_path / "c" / "rank-00002-of-00006.safetensors"
    flip_byte_in(victim, "embed.weight")
    with pytest.raises(CheckpointError, match=f"{victim.name}.*'embed.weight'"):
        consolidate(str(tmp_path / "c"), str(tmp_path / "m.safetensors"))


@pytest.mark.parametrize("batch_bytes", [1, 20_000, None])
def test_small_inputs_read_in_batches_give_the_per_file_paths_bytes(wide, tmp_path, monkeypatch, batch_bytes):
    """Small inputs are read whole, a batch of files at a time, and gathered at once: batches of
    one file, of a few, or all in one give the bytes of the per-file path (a cast and HF's
    shards included: several outputs, pieces of many sizes)."""
    import zeroshard.toolkit.gather as gather

    root, _ = wide
    runs = {"batched": batch_bytes, "per file": None}
    for label, size in runs.items():
        with monkeypatch.context() as m:
            if label == "per file":
                m.setattr(gather, "WHOLE_HASH_BYTES", 0)
            elif size is not None:
                m.setattr(gather, "BATCH_BYTES", size)
            consolidate(str(root / "w300"), str(tmp_path / f"{label}.safetensors"), dtype="bf16")
            consolidate(str(root / "w300"), str(tmp_path / label), max_shard_size="3KB")
    assert (tmp_path / "batched.safetensors").read_bytes() == (tmp_path / "per file.safetensors").read_bytes()
    shards = sorted(p.name for p in (tmp_path / "per file").iterdir())
    assert len(shards) > 3 and shards == sorted(p.name for p in (tmp_path / "batched").iterdir())
    for name in shards:
        assert (tmp_path / "batched" / name).read_bytes() == (tmp_path / "per file" / name).read_bytes()


def rewrite_header_otherwise(folder: Path, rank_file: str) -> None:
    """Rewrite one rank file as another (valid) writer might: the same tensors, bytes and
    hashes, but its header JSON spaced otherwise; the manifest records the new size and hash."""
    import xxhash

    path = folder / rank_file
    data = path.read_bytes()
    start, end = _header_span(path)
    text = json.dumps(json.loads(data[start:end]), indent=1).encode()
    text += b" " * (-len(text) % 8)
    data = struct.pack("<Q", len(text)) + text + data[end:]
    path.write_bytes(data)
    manifest = json.loads((folder / "zeroshard.json").read_text())
    entry = next(f for f in manifest["files"] if f["name"] == rank_file)
    entry["size"], entry["hash"] = len(data), xxhash.xxh3_64_hexdigest(data)
    (folder / "zeroshard.json").write_text(json.dumps(manifest))


def test_a_small_input_with_a_header_written_otherwise_takes_the_checked_path(wide, tmp_path):
    """A batch holding a file whose header is not the one the plan's offsets assume is copied by
    the per-file path, which reads where that header says: same output."""
    import shutil

    root, model = wide
    shutil.copytree(root / "w300", tmp_path / "c")
    rewrite_header_otherwise(tmp_path / "c", "rank-00007-of-00300.safetensors")
    assert verify(str(tmp_path / "c")).ok
    consolidate(str(tmp_path / "c"), str(tmp_path / "m.safetensors"))
    assert_same(model, load_file(tmp_path / "m.safetensors"))
    flip_byte_in(tmp_path / "c" / "rank-00007-of-00300.safetensors", "t39")
    with pytest.raises(CheckpointError, match="rank-00007-of-00300.safetensors.*'t39'"):
        consolidate(str(tmp_path / "c"), str(tmp_path / "m2.safetensors"))
    assert not (tmp_path / "m2.safetensors").exists() and not leftovers(tmp_path)


def test_deep_verify_of_format_1_0_checks_the_manifests_fragment_hashes(tmp_path):
    """In 1.0 the fragment hashes are the manifest's: one that disagrees with intact data is
    found by --deep only (the file's own hash still holds)."""
    import shutil

    shutil.copytree(FORMAT_1_0 / "training-w3", tmp_path / "c")
    assert verify(str(tmp_path / "c"), deep=True).ok
    manifest_path = tmp_path / "c" / "zeroshard.json"
    manifest = json.loads(manifest_path.read_text())
    fragment = manifest["tensors"]["embed.weight"]["fragments"][1]
    fragment[3] = f"{int(fragment[3], 16) ^ 1:016x}"
    manifest_path.write_text(json.dumps(manifest))
    assert verify(str(tmp_path / "c")).ok
    report = verify(str(tmp_path / "c"), deep=True)
    assert len(report.problems) == 1 and "rank-00001-of-00003.safetensors" in report.problems[0]
    assert "embed.weight" in report.problems[0]
