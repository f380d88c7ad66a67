"""Hostile or unusual foreign checkpoints (issue 51, round 3): sizes a file declares are checked
against the bytes it holds before anything is allocated; a DCP `.metadata` of the wrong shapes
or types is refused in one line naming it, however deep it nests; optimizer state flattened at
the top level of a DCP checkpoint is imported as optimizer state, never as weights."""

from __future__ import annotations

import collections
import io
import math
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_safety_interop import assert_refused, cli, edit_metadata, save_dcp

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.interop import torch_zip
from zeroshard.interop.dcp_import import read_dcp
from zeroshard.interop.torch_pickle import allowlist, load_pt

from distributed import run_ranks
from interop_model import batch, make_model, make_optimizer, mean_over_ranks, zeroshard_resumed_losses

TIER = "default"  # docs/TESTING.md

FIXTURES = Path(__file__).parent / "data" / "deepspeed"
HUGE = 2**36  # fp32 elements: 256 GiB
VICTIM = "zero_pp_rank_1_mp_rank_00_optim_states.pt"

# ---------------------------------------------------------------- 1. size bombs


class _Ref:
    """Stands for a storage in a hand-written pickle: its declared element count."""

    def __init__(self, numel: int) -> None:
        self.numel = numel


class _Tensor:
    """Pickles as torch's own `_rebuild_tensor_v2(storage, offset, shape, stride, ...)`."""

    def __init__(self, numel: int, shape: tuple, stride: tuple) -> None:
        self.args = (_Ref(numel), 0, shape, stride)

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict())


def _pickle(obj, legacy: bool) -> bytes:
    """`obj` pickled as torch.save does, each _Ref a persistent storage id (fp32, key "0")."""
    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _Ref):
                return ("storage", torch.FloatStorage, "0", "cpu", o.numel) + ((None,) if legacy else ())
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _zip_file(obj, data: bytes = b"\0" * 4) -> bytes:
    """A torch.save zip archive of `obj` whose one storage record holds `data`."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", _pickle(obj, legacy=False))
        z.writestr("archive/byteorder", sys.byteorder)
        z.writestr("archive/data/0", data)
        z.writestr("archive/version", "3\n")
    return out.getvalue()


def _legacy_file(obj, data: bytes = b"\0" * 4) -> bytes:
    """The same in torch's legacy (before 1.6, not zip) format: magic, protocol, system info,
    the pickle, its storage keys, then each storage's element count and bytes."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    out = io.BytesIO()
    info = {"protocol_version": PROTOCOL_VERSION, "little_endian": sys.byteorder == "little",
            "type_sizes": {"short": 2, "int": 4, "long": 4}}
    for header in (MAGIC_NUMBER, PROTOCOL_VERSION, info):
        pickle.dump(header, out, protocol=2)
    out.write(_pickle(obj, legacy=True))
    pickle.dump(["0"], out, protocol=2)
    out.write(struct.pack("<q", len(data) // 4) + data)
    return out.getvalue()


def _bombed_deepspeed(tmp_path: Path, tensor: _Tensor, legacy: bool = False) -> Path:
    """A copy of a real DeepSpeed ZeRO-2 checkpoint whose rank-1 optimizer file is rewritten,
    its fp32 partition replaced by `tensor` (everything else as DeepSpeed wrote it, DeepSpeed's
    own classes as plain values: this test writes with pickle, not with DeepSpeed)."""
    root = tmp_path / "ds"
    shutil.copytree(FIXTURES / "stage2", root)
    path = root / "global_step3" / VICTIM
    with allowlist():
        sd = torch.load(path, weights_only=True)
    osd = sd["optimizer_state_dict"]
    osd["loss_scaler"], osd["zero_stage"], osd["param_slice_mappings"] = None, 2, []
    osd["base_optimizer_state"] = {"state": {}, "param_groups": []}
    osd["single_partition_of_fp32_groups"] = [tensor]
    path.write_bytes((_legacy_file if legacy else _zip_file)(sd))
    assert path.stat().st_size < 4096
    return root


_CAPPED = """
import resource, sys, time
import torch  # imported before the clock starts: what is timed is the import command alone
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a regression fails, not the machine
from zeroshard.cli import main
start = time.process_time()
try:
    main(sys.argv[1:])
finally:
    print(f"cpu {time.process_time() - start:.3f}", file=sys.stderr)
"""


def _capped(*args: str) -> tuple[int, str, float]:
    """`zeroshard ARGS` in a process limited to 4 GiB of address space: exit code, its error
    lines, and the CPU seconds the command took."""
    done = subprocess.run([sys.executable, "-c", _CAPPED, *args, "-q"], capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("cpu "), done.stderr
    return done.returncode, "\n".join(lines[:-1]), float(lines[-1].split()[1])


@pytest.mark.parametrize("tensor, legacy", [
    (_Tensor(1, (HUGE,), (0,)), False),   # stride 0: 4 bytes stored, 256 GiB on the first copy
    (_Tensor(1, (1, HUGE), (HUGE, 0)), False),
    (_Tensor(HUGE, (HUGE,), (1,)), True),  # a legacy file: torch allocates what the storage declares
    (_Tensor(1, (HUGE,), (0,)), True),
], ids=["zip-stride0", "zip-stride0-2d", "legacy-declared-storage", "legacy-stride0"])
def test_a_4kb_deepspeed_file_declaring_256_gib_is_refused_before_allocating(tmp_path, tensor, legacy):
    src = _bombed_deepspeed(tmp_path, tensor, legacy)
    code, err, cpu = _capped("import", "deepspeed", str(src), str(tmp_path / "out"))
    assert code != 0 and len(err.splitlines()) == 1, err
    assert err.startswith("zeroshard: error: ") and "internal" not in err, err
    assert f"global_step3/{VICTIM}" in err, err  # the file, not only its folder
    assert "allocat" in err and ("declare" in err), err
    assert cpu < 5.0, cpu  # refused at once (about 0.5 s here), not after a 256 GiB attempt
    assert not (tmp_path / "out" / "zeroshard.json").exists()


def test_pickled_model_with_a_stride0_view_is_refused(tmp_path):
    """`zeroshard shard model.pt`: the same archive reader, which reads contiguous tensors only."""
    path = tmp_path / "model.pt"
    path.write_bytes(_zip_file({"w": _Tensor(1, (HUGE,), (0,)), "b": _Tensor(1, (1,), (1,))}))
    code, err, _ = _capped("shard", str(path), str(tmp_path / "out"), "--world", "2")
    assert code != 0 and len(err.splitlines()) == 1 and str(path) in err, err


def test_dcp_chunk_blobs_and_beside_files_check_their_views(tmp_path):
    """A DCP chunk is a torch.save archive at a byte range (torch_zip.load); small files beside a
    checkpoint (schedulers, RNG states) go through torch_pickle.load_pt; both refuse the view."""
    path = tmp_path / "blob.pt"
    path.write_bytes(_zip_file({"x": _Tensor(1, (HUGE,), (0,))}))
    with pytest.raises(CheckpointError, match="declares 274877906944 bytes"):
        torch_zip.load(torch_zip.open_archive(str(path), str(tmp_path)), lazy_bytes=0)
    for maker in (_zip_file, _legacy_file):
        path.write_bytes(maker({"x": _Tensor(1, (HUGE,), (0,))}))
        with pytest.raises(CheckpointError, match="stride-0") as info:
            load_pt(str(path))
        assert info.value.where == str(path)
    path.write_bytes(_legacy_file({"x": _Tensor(HUGE, (2,), (1,))}))  # a small view of a huge storage
    with pytest.raises(CheckpointError, match="declare 274877906944 bytes"):
        load_pt(str(path))
    path.write_bytes(_legacy_file({"x": _Tensor(1, (1,), (1,))}, struct.pack("<f", 2.5)))  # a sound one
    assert load_pt(str(path))["x"].tolist() == [2.5]


# ---------------------------------------------------------------- 2. DCP metadata shapes


def _deep(levels: int) -> list:
    nested: list = []
    for _ in range(levels):
        nested = [nested]
    return nested


def _set_planner(value):
    def edit(metadata):
        metadata.planner_data = dict(metadata.planner_data)
        metadata.planner_data["model.w"] = value
    return edit


@pytest.mark.parametrize("edit, needle", [
    (_set_planner([["model"], "w"]), "planner_data"),
    (_set_planner(_deep(10_000)), "planner_data"),
    (_set_planner(("model",) * 100), "planner_data"),
    (_set_planner(("model", 1.5)), "planner_data"),
    (lambda m: setattr(m, "planner_data", {(("a",),): ("model", "w")}), "planner_data"),
    (lambda m: next(iter(m.storage_data.values())).__setattr__("offset", _deep(10_000)), "offset"),
    (lambda m: next(iter(m.storage_data.values())).__setattr__("relative_path", _deep(10_000)), "storage path"),
    (lambda m: object.__setattr__(next(iter(m.storage_data)), "offset", _deep(10_000)), "position"),
], ids=["list-in-path", "10000-deep", "too-long", "float", "tuple-key", "deep-offset", "deep-path",
        "deep-index"])
def test_dcp_metadata_of_the_wrong_shape_is_one_line_naming_the_file(tmp_path, edit, needle):
    src = save_dcp(tmp_path / "dcp")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(40_000)  # for pickle.dumps here; the import copes with the default
    try:
        edit_metadata(src, edit)
    finally:
        sys.setrecursionlimit(limit)
    code, output = cli("import", "dcp", str(src), str(tmp_path / "out"))
    assert_refused(code, output, str(src / ".metadata"), needle)
    assert "internal error" not in output and "Recursion" not in output, output


# ---------------------------------------------------------------- 3. optimizer flattened at the top level


def _top_level_flattened(rank: int, world_size: int, out: str) -> dict:
    """DDP + AdamW train 6 steps; after step 2, `dcp.save({**model_sd, **flattened_optim_sd})`
    with torch's own get_state_dict(flatten_optimizer_state_dict=True). Returns the losses of
    steps 3-5, the keys saved, and (rank 0) the optimizer's own moments at the save, by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model = torch.nn.parallel.DistributedDataParallel(make_model(0))
    opt = make_optimizer(model.parameters())
    losses, keys, moments = [], [], {}
    for step in range(6):
        loss = model(*batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
        if step == 2:
            msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
            dcp.save({**msd, **osd}, checkpoint_id=out)
            keys = sorted({**msd, **osd})
            moments = {f"{n}/{k}": v.tolist() for n, p in model.module.named_parameters()
                       for k, v in opt.state[p].items() if k != "step"}
    return {"losses": losses[3:], "keys": keys, "moments": moments}


@pytest.fixture(scope="module")
def top_level(tmp_path_factory):
    out = tmp_path_factory.mktemp("top") / "dcp"
    return out, run_ranks(_top_level_flattened, 2, out=str(out), timeout=240)[0]


def test_top_level_flattened_optimizer_is_optimizer_state_not_weights(top_level):
    folder, saved = top_level
    names = [n for n, _ in make_model(0).named_parameters()]
    # torch's spelling, as this torch wrote it: state.<fqn>.<k> and param_groups.<fqn>.<k>, no prefix
    assert f"state.{names[0]}.exp_avg" in saved["keys"] and f"param_groups.{names[0]}.lr" in saved["keys"]
    assert not any(k.startswith(("optim", "model.")) for k in saved["keys"])
    imp = read_dcp(str(folder))
    assert sorted(imp.params) == sorted(names)  # the model's parameters only: no moment is a weight
    assert not any(k.startswith(("state.", "param_groups.")) for k in [*imp.buffers, *imp.aliases])
    assert imp.notes[0] == "DCP layout: top-level model keys, flattened optimizer at the top level " \
                           "('state.*', 'param_groups.*')"
    for name in names:
        assert set(imp.optimizer_state[name]) == {"exp_avg", "exp_avg_sq"}
        for k, v in imp.optimizer_state[name].items():  # bit-exact against the optimizer's own state
            expected = torch.tensor(saved["moments"][f"{name}/{k}"]).reshape(-1)
            assert torch.equal(torch.as_tensor(v).reshape(-1), expected), (name, k)
        assert imp.scalar_state[name]["step"]["value"] == 3
    assert imp.optimizer_class == "torch.optim.adamw.AdamW" and imp.global_steps == 3


def test_top_level_flattened_optimizer_resumes_like_ddp(tmp_path, top_level):
    folder, saved = top_level
    result = CliRunner().invoke(main, ["import", "dcp", str(folder), str(tmp_path / "zs"), "--world", "2", "-q"])
    assert result.exit_code == 0, result.output
    assert f"{len(list(make_model(0).parameters()))} parameters" in result.output, result.output
    ours = run_ranks(zeroshard_resumed_losses, 2, path=str(tmp_path / "zs"), init_process_group=False, timeout=240)[0]
    assert len(ours) == 3 and all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours, saved["losses"])), \
        (ours, saved["losses"])


def test_top_level_moments_without_param_groups_are_refused(tmp_path):
    """Flattened state with its param_groups entries gone: refused, never imported as weights."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(4, 3), "state.w.exp_avg": torch.randn(4, 3), "state.w.exp_avg_sq": torch.rand(4, 3)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    code, output = cli("import", "dcp", str(tmp_path / "dcp"), str(tmp_path / "out"))
    assert_refused(code, output, "state.w.exp_avg", "not weights")
