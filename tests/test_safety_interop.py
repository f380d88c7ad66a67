"""Imports (DeepSpeed, DCP) and DCP export, tried as an adversary would (issue 17): outputs never
destroy inputs or old outputs, foreign metadata is checked before anything is allocated from it,
FIFOs/devices/folders/escaping links are refused on open, pickles never run code. Every failure
is one line naming the file, with inputs and previous outputs byte-identical.

Real inputs only: the DeepSpeed fixtures made by real DeepSpeed (tests/data/deepspeed) and DCP
checkpoints written here by torch.distributed.checkpoint.save itself."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.format import open_checkpoint
from zeroshard.interop.dcp_metadata import load_metadata
from zeroshard.storage import Location
from zeroshard.storage.claim import take_claim

from interop_model import make_model, make_optimizer
from test_bad_input import _cli_with_file_size_limit

TIER = "mixed"  # docs/TESTING.md

FIXTURES = Path(__file__).parent / "data" / "deepspeed"
TAG = "global_step3"
pytestmark = pytest.mark.timeout(120)


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (hidden ones included, links not followed), by relative path ->
    SHA-256 of a file, the target of a link, or its kind (reading a FIFO would block)."""
    out = {}
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(parent) / name
            if p.is_symlink():
                out[str(p.relative_to(folder))] = "link:" + os.readlink(p)
            elif p.is_file():
                out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[str(p.relative_to(folder))] = "folder" if p.is_dir() else "special"
    return out


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args, "-q"])
    return result.exit_code, result.output


def assert_refused(code: int, output: str, *needles: str) -> None:
    assert code != 0, output
    assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
    for needle in needles:
        assert needle in output, output


def ds_copy(tmp_path: Path, stage: int | str = 2, name: str = "ds") -> Path:
    """A writable copy of a real DeepSpeed checkpoint root (latest + tag folder); `stage` a
    ZeRO stage or a variant fixture's folder name (offload, bf16, hf, universal)."""
    root = tmp_path / name
    shutil.copytree(FIXTURES / (stage if isinstance(stage, str) else f"stage{stage}"), root)
    return root


def resave(path: Path, edit) -> None:
    """Load a real DeepSpeed file (trusted: our own fixture, DeepSpeed installed), edit, save back."""
    pytest.importorskip("deepspeed", reason="editing a DeepSpeed pickle needs DeepSpeed (dev.sh test --all has it)")
    obj = torch.load(path, weights_only=False)
    edit(obj)
    torch.save(obj, path)


def resave_nested(path: Path, put) -> None:
    """resave, putting a list nested 3,000 deep into the object with `put(obj, nested)`."""
    nested: list = []
    for _ in range(3000):
        nested = [nested]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # for torch.save here; the import must cope with the default
    try:
        resave(path, lambda obj: put(obj, nested))
    finally:
        sys.setrecursionlimit(limit)


def save_dcp(folder: Path) -> Path:
    """A real DCP checkpoint in FSDP2's {"model", "optim"} layout, written by dcp.save itself."""
    import torch.distributed.checkpoint as dcp

    w, b = torch.randn(4, 3), torch.randn(2)
    state = {"model": {"w": w, "b": b},
             "optim": {"state": {"w": {"exp_avg": torch.randn(4, 3), "step": torch.tensor(3.0)}},
                       "param_groups": [{"lr": 0.1, "params": ["w"]}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return folder


def edit_metadata(folder: Path, edit) -> None:
    """Rewrite `.metadata` with `edit(metadata)` applied (a plain pickle, as DCP writes it; this
    test wrote it, so plain pickle.loads gives back DCP's own classes to edit)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    edit(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def zs_ckpt(tmp_path: Path, name: str = "ck") -> Path:
    out = tmp_path / name
    assert cli("import", "deepspeed", str(FIXTURES / "stage2"), str(out))[0] == 0
    return out


# ---- export dcp: outputs ----------------------------------------------------------------------
def test_export_onto_its_own_input_is_refused(tmp_path):
    ck = zs_ckpt(tmp_path)
    before = snapshot(ck)
    for out in (ck, ck / ".", ck / "sub"):
        assert_refused(*cli("export", "dcp", str(ck), str(out), "--overwrite"), "input")
    assert snapshot(ck) == before


def test_export_onto_the_root_of_a_run_is_refused(tmp_path):
    root = tmp_path / "run"
    for step in ("step-1", "step-2"):
        assert cli("import", "deepspeed", str(FIXTURES / "stage2"), str(root / step))[0] == 0
    (root / "latest").write_text("step-2\n")
    before = snapshot(root)
    assert_refused(*cli("export", "dcp", str(root / "step-2"), str(root), "--overwrite"), "contains")
    assert_refused(*cli("export", "dcp", str(root), str(root / "step-3")), "inside")
    assert snapshot(root) == before


def test_export_over_an_existing_output_needs_overwrite_and_then_replaces_it_cleanly(tmp_path):
    ck = zs_ckpt(tmp_path)
    out = tmp_path / "dcp"
    assert cli("export", "dcp", str(ck), str(out))[0] == 0
    (out / "__9_0.distcp").write_bytes(b"stale data file of an older export")
    before = snapshot(out)
    assert_refused(*cli("export", "dcp", str(ck), str(out)), str(out))
    assert snapshot(out) == before
    assert cli("export", "dcp", str(ck), str(out), "--overwrite")[0] == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [".metadata", "__0_0.distcp"], names  # stale file gone, no stage, no claim
    assert cli("import", "dcp", str(out), str(tmp_path / "back"))[0] == 0


def test_failed_export_overwrite_keeps_the_old_export(tmp_path):
    ck = zs_ckpt(tmp_path)
    out = tmp_path / "dcp"
    assert cli("export", "dcp", str(ck), str(out))[0] == 0
    before = snapshot(out)
    limit = (out / "__0_0.distcp").stat().st_size // 2
    result = _cli_with_file_size_limit(limit, "export", "dcp", "-q", "--overwrite", str(ck), str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert snapshot(out) == before
    assert cli("import", "dcp", str(out), str(tmp_path / "back"))[0] == 0


def test_export_into_an_output_with_a_live_claim_is_refused(tmp_path):
    ck = zs_ckpt(tmp_path)
    out = tmp_path / "dcp"
    assert cli("export", "dcp", str(ck), str(out))[0] == 0
    before = snapshot(out)
    held = take_claim(Location(str(out)))  # another writer, alive (this very process)
    try:
        assert_refused(*cli("export", "dcp", str(ck), str(out), "--overwrite"), str(out))
        assert {k: v for k, v in snapshot(out).items() if not k.startswith(".zeroshard-claim")} == before
    finally:
        held.release()


KILLED_BEFORE_DCP_COMMIT = (
    "import os, signal, sys\n"
    "import torch.distributed.checkpoint as dcp\n"
    "def dying(self, metadata, results): os.kill(os.getpid(), signal.SIGKILL)\n"
    "dcp.FileSystemWriter.finish = dying\n"
    "from zeroshard.cli import main\n"
    "sys.argv = ['zeroshard'] + sys.argv[1:]\n"
    "main()\n")


@pytest.mark.parametrize("existing", [False, True])
def test_a_killed_export_leaves_only_what_clean_removes(tmp_path, existing):
    """SIGKILL after DCP wrote its data files, before `.metadata`: the old export (if any) is
    whole, and `zeroshard clean` removes every leftover (no orphan .distcp beside the output)."""
    ck = zs_ckpt(tmp_path)
    out = tmp_path / "dcp"
    if existing:
        assert cli("export", "dcp", str(ck), str(out))[0] == 0
    before = snapshot(out) if existing else {}
    result = subprocess.run([sys.executable, "-c", KILLED_BEFORE_DCP_COMMIT, "export", "dcp", "-q", "--overwrite",
                             str(ck), str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert [p for p in out.iterdir() if p.name.startswith(".zeroshard-")], "expected a stage and a claim"
    code, output = cli("clean", str(out), "--older-than", "0s", "--yes")
    assert code == 0, output
    assert snapshot(out) == before


@pytest.mark.parametrize("kind", ["export", "deepspeed", "dcp"])
def test_output_that_is_an_existing_file_is_refused_and_kept(tmp_path, kind):
    src = zs_ckpt(tmp_path) if kind == "export" else ds_copy(tmp_path) if kind == "deepspeed" \
        else save_dcp(tmp_path / "dcp")
    target = tmp_path / "file"
    target.write_bytes(b"precious")
    args = ("export", "dcp") if kind == "export" else ("import", kind)
    assert_refused(*cli(*args, str(src), str(target), "--overwrite"), str(target))
    assert target.read_bytes() == b"precious"


# ---- imports: outputs ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["deepspeed", "dcp"])
def test_import_into_its_own_source_is_refused(tmp_path, kind):
    src = ds_copy(tmp_path) if kind == "deepspeed" else save_dcp(tmp_path / "dcp")
    before = snapshot(src)
    outs = [src, src / "out"] + ([src / TAG] if kind == "deepspeed" else [])
    for out in outs:
        assert_refused(*cli("import", kind, str(src), str(out), "--overwrite"), "input")
    assert snapshot(src) == before


@pytest.mark.parametrize("kind", ["deepspeed", "dcp"])
@pytest.mark.parametrize("world", ["-1", "0"])
def test_import_with_a_world_below_one_touches_nothing(tmp_path, kind, world):
    src = ds_copy(tmp_path) if kind == "deepspeed" else save_dcp(tmp_path / "dcp")
    out = tmp_path / "out"
    assert cli("import", kind, str(src), str(out))[0] == 0
    before = snapshot(out)
    assert_refused(*cli("import", kind, str(src), str(out), "--overwrite", "--world", world), "--world")
    assert snapshot(out) == before


@pytest.mark.parametrize("kind", ["deepspeed", "dcp"])
def test_failed_import_overwrite_keeps_the_old_output(tmp_path, kind):
    src = ds_copy(tmp_path) if kind == "deepspeed" else save_dcp(tmp_path / "dcp")
    out = tmp_path / "out"
    assert cli("import", kind, str(src), str(out), "--world", "1")[0] == 0
    before = snapshot(out)
    limit = max(p.stat().st_size for p in out.iterdir()) // 2
    result = _cli_with_file_size_limit(limit, "import", kind, "-q", "--overwrite", str(src), str(out), "--world", "1")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert snapshot(out) == before
    assert cli("verify", str(out))[0] == 0


@pytest.mark.parametrize("kind", ["deepspeed", "dcp"])
def test_import_into_an_output_with_a_live_claim_is_refused(tmp_path, kind):
    src = ds_copy(tmp_path) if kind == "deepspeed" else save_dcp(tmp_path / "dcp")
    out = tmp_path / "out"
    assert cli("import", kind, str(src), str(out))[0] == 0
    before = snapshot(out)
    held = take_claim(Location(str(out)))
    try:
        assert_refused(*cli("import", kind, str(src), str(out), "--overwrite"), str(out))
        assert {k: v for k, v in snapshot(out).items() if not k.startswith(".zeroshard-claim")} == before
    finally:
        held.release()


KILLED_BEFORE_IMPORT_COMMIT = (
    "import os, signal, sys\n"
    "from zeroshard.interop import write\n"
    "def dying(*args, **kwargs): os.kill(os.getpid(), signal.SIGKILL)\n"
    "write.build_manifest = dying\n"
    "from zeroshard.cli import main\n"
    "sys.argv = ['zeroshard'] + sys.argv[1:]\n"
    "main()\n")


@pytest.mark.parametrize("existing", [False, True])
def test_a_killed_import_leaves_only_what_clean_removes(tmp_path, existing):
    """SIGKILL once every rank file is written, before the manifest: the old output (if any) is
    whole, and after `zeroshard clean` nothing of the killed run is left (no manifest-less rank files)."""
    src = ds_copy(tmp_path)
    out = tmp_path / "out"
    if existing:
        assert cli("import", "deepspeed", str(src), str(out))[0] == 0
    before = snapshot(out) if existing else {}
    result = subprocess.run([sys.executable, "-c", KILLED_BEFORE_IMPORT_COMMIT, "import", "deepspeed", "-q",
                             "--overwrite", str(src), str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert [p for p in out.iterdir() if p.name.startswith(".zeroshard-")], "expected a stage and a claim"
    code, output = cli("clean", str(out), "--older-than", "0s", "--yes")
    assert code == 0, output
    assert snapshot(out) == before


def test_deepspeed_latest_naming_a_link_out_of_the_root_is_refused(tmp_path):
    root = ds_copy(tmp_path)
    shutil.move(root / TAG, tmp_path / "elsewhere")
    (root / TAG).symlink_to(tmp_path / "elsewhere")
    _refused_import(root, tmp_path, "latest")


# ---- import deepspeed: hostile folders and files ------------------------------------------
def _refused_import(src: Path, tmp_path: Path, *needles: str) -> None:
    before = snapshot(src)
    assert_refused(*cli("import", "deepspeed", str(src), str(tmp_path / "out")), *needles)
    assert snapshot(src) == before
    assert not (tmp_path / "out" / "zeroshard.json").exists()


OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"


@pytest.mark.parametrize("victim", [OPTIM1, MODEL])
@pytest.mark.parametrize("what", ["fifo", "folder"])
def test_deepspeed_fifo_or_folder_instead_of_a_rank_file_is_refused_without_hanging(tmp_path, victim, what):
    root = ds_copy(tmp_path)
    path = root / TAG / victim
    path.unlink()
    os.mkfifo(path) if what == "fifo" else path.mkdir()
    _refused_import(root, tmp_path, victim)


def test_deepspeed_rank_file_linked_out_of_the_folder_is_refused(tmp_path):
    root = ds_copy(tmp_path)
    outside = tmp_path / "elsewhere.pt"
    shutil.move(root / TAG / OPTIM1, outside)  # the very same bytes: only the link is wrong
    (root / TAG / OPTIM1).symlink_to(outside)
    _refused_import(root, tmp_path, OPTIM1, "link")


@pytest.mark.parametrize("content", [b"\xff\xfe\xfa", b"global_step3" * 500_000, "fifo"],
                         ids=["not-utf8", "5MB", "fifo"])
def test_deepspeed_bad_latest_is_one_line_naming_it(tmp_path, content):
    root = ds_copy(tmp_path)
    (root / "latest").unlink()
    os.mkfifo(root / "latest") if content == "fifo" else (root / "latest").write_bytes(content)
    _refused_import(root, tmp_path, "latest")


def test_deepspeed_checkpoint_under_a_folder_with_glob_characters_imports(tmp_path):
    root = ds_copy(tmp_path, name="lr[3e-4]*?")
    for src in (root, root / TAG):
        out = tmp_path / f"out-{src.name}"
        code, output = cli("import", "deepspeed", str(src), str(out))
        assert code == 0, output
        assert cli("verify", str(out))[0] == 0


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("global_steps", "two"), ("skipped_steps", 1.5),
                                          ("param_shapes", "nope")])
def test_deepspeed_model_field_of_the_wrong_type_is_one_line(tmp_path, field, value):
    root = ds_copy(tmp_path)
    resave(root / TAG / MODEL, lambda m: m.__setitem__(field, value))
    _refused_import(root, tmp_path, MODEL, field)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("shape", [[-4, 3], [10**12, 10**12], ["two"]], ids=["negative", "absurd", "not-int"])
def test_deepspeed_absurd_or_negative_param_shapes_never_reach_the_allocator(tmp_path, shape, stage):
    root = ds_copy(tmp_path, stage)
    model = MODEL if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"

    def edit(model):
        first = next(iter(model["param_shapes"][0]))
        model["param_shapes"][0][first] = shape

    resave(root / TAG / model, edit)
    _refused_import(root, tmp_path, "param_shapes")  # the model file's, or the optimizer files' they exceed


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("shape", [[-4, 3], [10**12, 10**12], ["two"], "buffer"],
                         ids=["negative", "absurd", "not-int", "a-buffer-name"])
def test_deepspeed_hostile_frozen_parameter_shapes_are_one_line(tmp_path, shape, stage):
    root = ds_copy(tmp_path, f"frozen_stage{stage}")
    model = MODEL if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"

    def edit(model):
        if shape == "buffer":  # a frozen parameter under a buffer's name
            model["frozen_param_shapes"]["scale"] = model["frozen_param_shapes"].pop("fc.bias")
        else:
            model["frozen_param_shapes"]["fc.weight"] = shape

    resave(root / TAG / model, edit)
    needles = ["'scale'", "frozen parameter"] if shape == "buffer" else [
        "param_shapes" if shape != [10**12, 10**12] else "frozen parameter 'fc.weight'"]
    _refused_import(root, tmp_path, model, *needles)


@pytest.mark.slow
def test_deepspeed_client_state_holding_tensors_is_refused_other_non_json_is_noted(tmp_path):
    """An EMA copy in client_state is model data: refused, never imported without it. Non-JSON
    data that is no tensor (bytes) is left out with a note, and a 0-d tensor is a number."""
    root = ds_copy(tmp_path)
    resave(root / TAG / MODEL,
           lambda m: m.update(ema={"fc.weight": torch.randn(5, 5)}, blob=b"x", loss=torch.tensor(2.5)))
    _refused_import(root, tmp_path, MODEL, "client_state['ema'] holds tensors")
    resave(root / TAG / MODEL, lambda m: m.pop("ema"))
    code, output = cli("import", "deepspeed", str(root), str(tmp_path / "out"))
    assert code == 0 and "client_state['blob']" in output and "left out" in output, output
    assert open_checkpoint(str(tmp_path / "out"))[1].client_state["loss"] == 2.5


@pytest.mark.slow
def test_deepspeed_deeply_nested_client_state_is_one_line(tmp_path):
    root = ds_copy(tmp_path)
    resave_nested(root / TAG / MODEL, lambda m, nested: m.__setitem__("my_client_state", nested))
    _refused_import(root, tmp_path, MODEL)


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("zero_stage", "two"), ("partition_count", [3])])
def test_deepspeed_optimizer_field_wrong_is_one_line(tmp_path, field, value):
    root = ds_copy(tmp_path)
    for rank in (0, 1):
        resave(root / TAG / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
               lambda o: o["optimizer_state_dict"].__setitem__(field, value))
    _refused_import(root, tmp_path, TAG)


def test_deepspeed_missing_or_extra_rank_files_are_refused(tmp_path):
    root = ds_copy(tmp_path)
    (root / TAG / OPTIM1).unlink()
    _refused_import(root, tmp_path, "partitions")  # rank 0 says 2 partitions, 1 file present
    root = ds_copy(tmp_path, name="ds-extra")
    shutil.copy(root / TAG / OPTIM1, root / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    _refused_import(root, tmp_path, "partitions")
    root = ds_copy(tmp_path, name="ds-gap")
    shutil.move(root / TAG / OPTIM1, root / TAG / "zero_pp_rank_5_mp_rank_00_optim_states.pt")
    _refused_import(root, tmp_path, "ranks")


@pytest.mark.slow
def test_deepspeed_pickle_naming_a_stand_in_module_function_runs_nothing(tmp_path):
    """A pickle reaching for a callable that is not on the allowlist, placed where DeepSpeed's own
    class names are expected: refused before it is called."""
    root = ds_copy(tmp_path)
    side = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(side)],))

    resave(root / TAG / MODEL, lambda m: m.__setitem__("client", {"x": Evil()}))
    _refused_import(root, tmp_path, MODEL, "refused")
    assert not side.exists()


# ---- import deepspeed: the layouts of real runs (offload, bf16, HF Trainer, universal) -------
def _evil(side: Path):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {side}",))

    return Evil()


@pytest.mark.slow
@pytest.mark.parametrize("step", [10**30, float("nan"), float("inf")], ids=["absurd", "nan", "inf"])
def test_deepspeed_offload_int_step_out_of_range_is_one_line(tmp_path, step):
    root = ds_copy(tmp_path, "offload")
    for rank in (0, 1):
        resave(root / TAG / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
               lambda o: o["optimizer_state_dict"]["base_optimizer_state"]["state"][0].__setitem__("step", step))
    _refused_import(root, tmp_path, "zero_pp_rank_0", "'step'")


@pytest.mark.slow
def test_deepspeed_bias_correction_false_is_refused(tmp_path):
    root = ds_copy(tmp_path, "offload")
    for rank in (0, 1):
        resave(root / TAG / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
               lambda o: o["optimizer_state_dict"]["base_optimizer_state"]["param_groups"][0].__setitem__(
                   "bias_correction", False))
    _refused_import(root, tmp_path, "bias_correction")


BF16 = "bf16_zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def test_deepspeed_bf16_missing_extra_or_mixed_rank_files_are_refused(tmp_path):
    root = ds_copy(tmp_path, "bf16", "missing")
    (root / TAG / BF16.format(1)).unlink()
    _refused_import(root, tmp_path, "partitions")
    root = ds_copy(tmp_path, "bf16", "extra")
    shutil.copy(root / TAG / BF16.format(1), root / TAG / BF16.format(2))
    _refused_import(root, tmp_path, "partitions")
    root = ds_copy(tmp_path, "bf16", "mixed")  # a stage-2 save's files dropped into the same folder
    shutil.copy(FIXTURES / "stage2" / TAG / OPTIM1, root / TAG / OPTIM1)
    _refused_import(root, tmp_path, "bf16_zero_pp_rank_* and zero_pp_rank_*")


@pytest.mark.slow
def test_deepspeed_bf16_ranks_disagreeing_on_partition_count_are_refused(tmp_path):
    root = ds_copy(tmp_path, "bf16")
    resave(root / TAG / BF16.format(1), lambda o: o["optimizer_state_dict"].__setitem__("partition_count", [3]))
    _refused_import(root, tmp_path, "3 partitions")


@pytest.mark.parametrize("victim", [BF16.format(1), "zero/fc.weight/exp_avg.pt", "zero/optimizer_state.pt"],
                         ids=["bf16", "universal-state", "universal-common"])
def test_deepspeed_variant_pickle_with_a_callable_runs_nothing(tmp_path, victim):
    variant, folder = ("bf16", TAG) if victim.startswith("bf16") else ("universal", "global_step3_universal")
    root = ds_copy(tmp_path, variant)
    side = tmp_path / "pwned"
    torch.save({"param": _evil(side)}, root / folder / victim)
    _refused_import(root, tmp_path, os.path.basename(victim), "refused")
    assert not side.exists()


def test_deepspeed_hf_run_folder_with_several_checkpoints_is_refused_listing_them(tmp_path):
    run = ds_copy(tmp_path, "hf", "run")
    shutil.copytree(run / "checkpoint-3", run / "checkpoint-10")
    _refused_import(run, tmp_path, "checkpoint-3, checkpoint-10", "name the one")
    assert cli("import", "deepspeed", str(run / "checkpoint-10"), str(tmp_path / "one"))[0] == 0


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"[" * 100_000, "sparse", "fifo", "link"],
                         ids=["not-json", "not-object", "deep", "huge", "fifo", "link-out"])
def test_deepspeed_hf_bad_trainer_state_is_one_line_naming_it(tmp_path, content):
    run = ds_copy(tmp_path, "hf", "run")
    path = run / "checkpoint-3" / "trainer_state.json"
    path.unlink()
    if content == "sparse":
        with open(path, "wb") as f:
            f.truncate(65 * 1024 * 1024)  # no bytes written: only the size is absurd
    elif content == "fifo":
        os.mkfifo(path)
    elif content == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        path.symlink_to(tmp_path / "elsewhere.json")
    else:
        path.write_bytes(content)
    _refused_import(run, tmp_path, "trainer_state.json")


def test_deepspeed_hf_checkpoint_folder_looping_back_is_not_followed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-1").symlink_to(run)  # a loop: must not recurse
    _refused_import(run, tmp_path, "not a DeepSpeed checkpoint")
    (run / "checkpoint-1").unlink()
    (run / "checkpoint-1" / "checkpoint-2").mkdir(parents=True)  # looked into once, not twice
    _refused_import(run, tmp_path, "checkpoint-1", "not a DeepSpeed checkpoint")


def test_deepspeed_hf_other_trainer_files_are_never_unpickled(tmp_path):
    """The Trainer also leaves pickles in checkpoint-N (training_args.bin, optimizer.pt): the
    import does not open them, so a callable in one runs nothing. Its scheduler.pt and
    rng_state_*.pth are read, through the allowlist: a hostile scheduler is refused, hostile RNG
    streams are left (named in a note: not model data); neither runs anything."""
    run = ds_copy(tmp_path, "hf", "run")
    side = tmp_path / "pwned"
    for name in ("training_args.bin", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "optimizer.pt"):
        torch.save(_evil(side), run / "checkpoint-3" / name)
    _refused_import(run, tmp_path, "scheduler.pt", "refused to unpickle", "move the file aside")
    assert not side.exists()
    (run / "checkpoint-3" / "scheduler.pt").unlink()  # the user's way to import without it
    code, output = cli("import", "deepspeed", str(run), str(tmp_path / "out"))
    assert code == 0, output
    assert not side.exists()
    assert "not imported (pickles are not read): optimizer.pt, training_args.bin" \
        in output, output  # named, so nothing is left behind unsaid
    assert "RNG streams not carried: " in output and "rng_state_0.pth: not read: " in output, output


def _lambda_lr_state(last_epoch: int) -> dict:
    """A torch LambdaLR's state dict (transformers' warmup schedules are LambdaLRs) after `last_epoch` steps."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=0.1), lambda s: 1 / (s + 1))
    for _ in range(last_epoch):
        scheduler.optimizer.step()
        scheduler.step()
    return scheduler.state_dict()


@pytest.mark.slow
def test_deepspeed_schedulers_beside_the_tag_folder_are_carried(tmp_path):
    """The Trainer's scheduler.pt (its own LambdaLR, not DeepSpeed's) is carried as `lr_scheduler`;
    with DeepSpeed holding one too, the files' come after it: lr_scheduler_1, lr_scheduler_2."""
    run = ds_copy(tmp_path, "hf", "run")
    torch.save(_lambda_lr_state(3), run / "checkpoint-3" / "scheduler.pt")
    code, output = cli("import", "deepspeed", str(run), str(tmp_path / "out"))
    assert code == 0 and "LR scheduler state carried: lr_scheduler from scheduler.pt" in output, output
    _, manifest = open_checkpoint(str(tmp_path / "out"))
    assert manifest.extra["stateful"] == {"lr_scheduler": json.loads(json.dumps(_lambda_lr_state(3)))}

    resave(run / "checkpoint-3" / TAG / MODEL, lambda m: m.__setitem__("lr_scheduler", {"last_batch_iteration": 2}))
    torch.save(_lambda_lr_state(1), run / "checkpoint-3" / "scheduler_1.pt")
    code, output = cli("import", "deepspeed", str(run), str(tmp_path / "out2"))
    assert code == 0 and "lr_scheduler_1 from scheduler.pt, lr_scheduler_2 from scheduler_1.pt" in output, output
    _, manifest = open_checkpoint(str(tmp_path / "out2"))
    assert manifest.extra["stateful"]["lr_scheduler"] == {"last_batch_iteration": 2}
    assert manifest.extra["stateful"]["lr_scheduler_2"]["last_epoch"] == 1


@pytest.mark.parametrize("content,needle", [
    ([1, 2], "holds a list, not a state dict"),
    ({"base_lrs": torch.ones(2, 2)}, "holds tensors"),
    ({"base_lrs": {1, 2}}, "cannot be stored as JSON"),
    (b"x" * (17 * 1024 * 1024), "more than the 16777216"),
], ids=["not-a-dict", "a-tensor", "a-set", "huge"])
def test_deepspeed_unreadable_scheduler_beside_is_refused_naming_it(tmp_path, content, needle):
    """A scheduler file that is no scheduler state is refused, not left out (the schedule would
    restart from its first step without a word)."""
    root = ds_copy(tmp_path, "accelerate")
    torch.save(content, root / "scheduler.bin")
    _refused_import(root, tmp_path, "scheduler.bin", needle)


@pytest.mark.parametrize("field, value, needle", [
    ("cpu", torch.zeros(4), "holds no torch CPU generator state"),
    ("python", (3, (1, 2, 3), None), "its Python `random` state is not random.getstate()'s"),
    ("numpy", ("MT19937", "keys", 0, 0, 0.0), "its NumPy state is not numpy.random.get_state()'s"),
    ("numpy", ("PCG64", None, 0, 0, 0.0), "its NumPy state is not numpy.random.get_state()'s"),
], ids=["torch-float", "python-short", "numpy-not-an-array", "numpy-other-generator"])
def test_deepspeed_hf_trainer_odd_rng_streams_are_left_with_a_note(tmp_path, field, value, needle):
    """An RNG file whose fields are not the generators' states: the streams are not carried (the
    engine's own stay), the note names the file and the field, and the import goes on."""
    run = ds_copy(tmp_path, "hf_trainer", "run")
    path = run / "checkpoint-3" / "rng_state_1.pth"
    saved = torch.load(path, weights_only=False)  # our own fixture, written by the Trainer
    saved[field] = value
    torch.save(saved, path)
    code, output = cli("import", "deepspeed", str(run), str(tmp_path / "out"))
    assert code == 0, output
    assert "RNG streams not carried: " in output and f"rng_state_1.pth: {needle}" in output, output
    _, manifest = open_checkpoint(str(tmp_path / "out"))
    assert not [n for n in manifest.tensors if n.startswith("rank-state/")]
    assert manifest.extra["stateful"]["lr_scheduler"]["last_epoch"] == 3  # the rest still carried


@pytest.mark.slow
def test_deepspeed_hf_trainer_state_clashing_with_a_client_key_is_refused(tmp_path):
    run = ds_copy(tmp_path, "hf", "run")
    resave(run / "checkpoint-3" / TAG / MODEL, lambda m: m.__setitem__("hf_trainer_state", {"mine": 1}))
    _refused_import(run, tmp_path, "hf_trainer_state")


UNI = "global_step3_universal"


def _uni_edit(root: Path, rel: str, value) -> None:
    torch.save(value, root / UNI / rel)


@pytest.mark.slow
@pytest.mark.parametrize("case, needles", [
    ("short-fp32", ("fp32.pt", "elements")),
    ("no-fp32", ("fp32.pt", "missing")),
    ("odd-file", ("x y.pt", "not an optimizer state file")),
    ("world", ("optimizer_state.pt", "partition_count")),
    ("groups", ("optimizer_state.pt", "param groups")),
    ("escaping-name", ("../../x",)),
    ("absurd-shape", ("fc.weight", "elements")),
    ("pointer", ("latest_universal", "not a universal checkpoint")),
    ("deep", ("optimizer_state.pt", "nested")),
])
def test_deepspeed_universal_hostile_folders_are_one_line(tmp_path, case, needles):
    root = ds_copy(tmp_path, "universal")
    zero = root / UNI / "zero"
    if case == "short-fp32":
        _uni_edit(root, "zero/fc.weight/fp32.pt", {"param": torch.zeros(3)})
    elif case == "no-fp32":
        (zero / "fc.bias" / "fp32.pt").unlink()
    elif case == "odd-file":
        shutil.copy(zero / "fc.bias" / "step.pt", zero / "fc.bias" / "x y.pt")
    elif case == "deep":
        resave_nested(zero / "optimizer_state.pt", lambda o, nested: o["param_groups"][0].__setitem__("mine", nested))
    elif case in ("world", "groups"):
        resave(zero / "optimizer_state.pt", lambda o: o.__setitem__("partition_count", [10**9]) if case == "world"
               else o["param_groups"].append(dict(o["param_groups"][0])))
    else:
        def edit(model):
            shapes = model["param_shapes"][0]
            if case == "escaping-name":
                shapes["../../x"] = shapes.pop("fc.bias")
            elif case == "absurd-shape":
                shapes["fc.weight"] = [10**12, 10**12]
        if case == "pointer":
            (root / "latest_universal").write_text("elsewhere")
            (root / "elsewhere").mkdir()
        else:
            resave(root / UNI / MODEL, edit)
    _refused_import(root, tmp_path, *needles)


# ---- import dcp: hostile metadata and files ---------------------------------------------------
def _refused_dcp(src: Path, tmp_path: Path, *needles: str) -> None:
    before = snapshot(src)
    assert_refused(*cli("import", "dcp", str(src), str(tmp_path / "out")), *needles)
    assert snapshot(src) == before
    assert not (tmp_path / "out" / "zeroshard.json").exists()


def _chunks(metadata, key: str, boxes: list[tuple[tuple, tuple]]) -> None:
    """Give tensor `key` the chunks `boxes`, each with a storage entry copying the original's range."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    entry = metadata.state_dict_metadata[key]
    original = next(k for k in metadata.storage_data if k.fqn == key)
    info = metadata.storage_data.pop(original)
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]
    for i, (o, _) in enumerate(boxes):
        metadata.storage_data[MetadataIndex(key, torch.Size(o), i)] = info


def test_dcp_metadata_is_read_without_dcp_code_its_fields_as_dcp_wrote_them(tmp_path):
    """The metadata's classes are stand-ins: reading it imports and runs nothing of
    torch.distributed.checkpoint, and every field comes back (against DCP's own reader)."""
    src = save_dcp(tmp_path / "dcp")
    code = ("import sys; from zeroshard.interop.dcp_metadata import load_metadata; "
            f"m = load_metadata({str(src / '.metadata')!r}); "
            "print(sorted(k for k in sys.modules if k.startswith('torch.distributed.checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    ours, theirs = load_metadata(str(src / ".metadata")), pickle.loads((src / ".metadata").read_bytes())
    assert sorted(ours.state_dict_metadata) == sorted(theirs.state_dict_metadata)
    for key, entry in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[key]
        assert type(mine).__name__ == type(entry).__name__
        if hasattr(entry, "size"):
            assert (mine.size, mine.properties.dtype) == (entry.size, entry.properties.dtype)
            assert [(c.offsets, c.sizes) for c in mine.chunks] == [(c.offsets, c.sizes) for c in entry.chunks]
    assert {(k.fqn, k.offset): (v.relative_path, v.offset, v.length, v.transform_descriptors)
            for k, v in ours.storage_data.items()} == \
        {(k.fqn, k.offset): (v.relative_path, v.offset, v.length, v.transform_descriptors)
         for k, v in theirs.storage_data.items()}
    assert ours.planner_data == theirs.planner_data


@pytest.mark.parametrize("boxes, needle", [
    ([((0, 0), (2, 3)), ((1, 0), (2, 3))], "overlap"),  # 12 elements counted, row 3 never written
    ([((0, 0), (2, 3))], "cover"),
    ([((0, 0), (4, 3)), ((3, 0), (2, 3))], "outside"),
], ids=["overlap-same-count", "gap", "out-of-bounds"])
def test_dcp_chunks_must_tile_each_tensor_exactly_once(tmp_path, boxes, needle):
    src = save_dcp(tmp_path / "dcp")
    edit_metadata(src, lambda m: _chunks(m, "model.w", boxes))
    _refused_dcp(src, tmp_path, ".metadata", "model.w", needle)


@pytest.mark.parametrize("size", [(-4, 3), (10**9, 10**9), (2**62,)], ids=["negative", "absurd", "absurd-1d"])
def test_dcp_absurd_or_negative_tensor_sizes_never_reach_the_allocator(tmp_path, size):
    src = save_dcp(tmp_path / "dcp")

    def edit(m):
        m.state_dict_metadata["model.w"].size = torch.Size(size)
        _chunks(m, "model.w", [((0,) * len(size), size)] if min(size) >= 0 else [((0, 0), (4, 3))])

    edit_metadata(src, edit)
    _refused_dcp(src, tmp_path, ".metadata", "model.w")


@pytest.mark.parametrize("field, value", [("offset", -1), ("length", 10**15), ("offset", 10**15),
                                          ("length", "two"), ("relative_path", 5),
                                          ("relative_path", "../elsewhere.distcp"), ("relative_path", "missing")])
def test_dcp_bad_storage_entries_are_one_line(tmp_path, field, value):
    src = save_dcp(tmp_path / "dcp")
    (tmp_path / "elsewhere.distcp").write_bytes((src / "__0_0.distcp").read_bytes())

    def edit(m):
        key = next(k for k in m.storage_data if k.fqn == "model.w")
        setattr(m.storage_data[key], field, value)

    edit_metadata(src, edit)
    _refused_dcp(src, tmp_path, "model.w" if field != "relative_path" or value != "missing" else "missing")


def test_dcp_chunk_storage_shorter_than_its_elements_is_refused(tmp_path):
    src = save_dcp(tmp_path / "dcp")

    def edit(m):
        key = next(k for k in m.storage_data if k.fqn == "model.w")
        m.storage_data[key].length = 8  # 12 float32 elements cannot fit in 8 bytes
        m.state_dict_metadata["model.w"].size = torch.Size((4, 3))

    edit_metadata(src, edit)
    _refused_dcp(src, tmp_path, "model.w", "8 bytes")


def test_dcp_two_entries_sharing_bytes_are_refused(tmp_path):
    """Entries pointing at the same bytes would let a small file claim huge tensors."""
    src = save_dcp(tmp_path / "dcp")

    def edit(m):
        w = next(k for k in m.storage_data if k.fqn == "model.w")
        b = next(k for k in m.storage_data if k.fqn == "model.b")
        m.storage_data[b].offset = m.storage_data[w].offset

    edit_metadata(src, edit)
    _refused_dcp(src, tmp_path, "__0_0.distcp", "share")


def test_dcp_bytes_entry_without_storage_is_refused(tmp_path):
    src = save_dcp(tmp_path / "dcp")
    edit_metadata(src, lambda m: m.storage_data.pop(next(k for k in m.storage_data if k.fqn.endswith(".lr"))))
    _refused_dcp(src, tmp_path, ".metadata", "lr", "no storage")


@pytest.mark.parametrize("victim", [".metadata", "__0_0.distcp"])
@pytest.mark.parametrize("what", ["fifo", "folder", "link-out"])
def test_dcp_fifo_folder_or_escaping_link_is_refused_without_hanging(tmp_path, victim, what):
    src = save_dcp(tmp_path / "dcp")
    path = src / victim
    if what == "link-out":
        shutil.move(path, tmp_path / victim)
        path.symlink_to(tmp_path / victim)
    else:
        path.unlink()
        os.mkfifo(path) if what == "fifo" else path.mkdir()
    _refused_dcp(src, tmp_path, victim)


def test_dcp_truncated_data_file_is_refused(tmp_path):
    src = save_dcp(tmp_path / "dcp")
    data = src / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    _refused_dcp(src, tmp_path, "__0_0.distcp", "past its end")


@pytest.mark.parametrize("case", ["hostile", "not-a-dict", "key-not-a-name", "per-rank-shards", "optimizer-by-index"])
def test_accelerate_full_state_dict_pickles_hostile_or_odd_are_one_line(tmp_path, case):
    """Accelerate's FULL_STATE_DICT save_state (pytorch_model_fsdp.bin + optimizer.bin) is read
    through the allowlist: a callable in it runs nothing; odd contents are one line naming the file."""
    src = tmp_path / "acc"
    src.mkdir()
    side = tmp_path / "pwned"
    model = make_model(0).state_dict()
    content = {"hostile": {"emb.weight": _evil(side)}, "not-a-dict": [1, 2], "key-not-a-name": {3: torch.ones(2)},
               "per-rank-shards": None, "optimizer-by-index": None}[case]
    if case == "optimizer-by-index":  # torch's own optimizer.state_dict() where FSDP's by-name one belongs
        torch.save(model, src / "pytorch_model_fsdp.bin")
        opt = make_optimizer(make_model(0).parameters())
        torch.save(opt.state_dict() | {"state": {0: {"step": torch.tensor(1.0)}}}, src / "optimizer.bin")
        _refused_dcp(src, tmp_path, "optimizer.bin", "by parameter index")
        return
    if case == "per-rank-shards":  # SHARDED_STATE_DICT with use_dcp=False: per-rank pickles of DTensors
        torch.save(model, src / "pytorch_model_fsdp_0_rank0.bin")
        _refused_dcp(src, tmp_path, "pytorch_model_fsdp_0_rank0.bin", "use_dcp=False")
        return
    torch.save(content, src / "pytorch_model_fsdp.bin")
    needle = {"hostile": "refused to unpickle", "not-a-dict": "holds a list, not a state dict",
              "key-not-a-name": "a key is a int"}[case]
    _refused_dcp(src, tmp_path, "pytorch_model_fsdp.bin", needle)
    assert not side.exists()


def test_dcp_hostile_pickle_in_a_data_blob_runs_nothing(tmp_path):
    """A chunk's bytes replaced by a torch.save'd object whose unpickling would run a command."""
    src = save_dcp(tmp_path / "dcp")
    side = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {side}",))

    evil = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, evil)
    (src / "evil.distcp").write_bytes(evil.read_bytes())

    def edit(m):
        key = next(k for k in m.storage_data if k.fqn == "optim.param_groups.0.lr")
        m.storage_data[key].relative_path, m.storage_data[key].offset = "evil.distcp", 0
        m.storage_data[key].length = evil.stat().st_size

    edit_metadata(src, edit)
    _refused_dcp(src, tmp_path, "evil.distcp", "refused")
    assert not side.exists()


def test_dcp_too_many_chunks_or_a_non_string_key_is_refused(tmp_path):
    src = save_dcp(tmp_path / "dcp")
    edit_metadata(src, lambda m: _chunks(m, "model.b", [((0,), (0,))] * 2000 + [((0,), (2,))]))
    _refused_dcp(src, tmp_path, ".metadata", "model.b", "at most")
    src = save_dcp(tmp_path / "dcp2")
    edit_metadata(src, lambda m: m.state_dict_metadata.__setitem__(7, m.state_dict_metadata["model.b"]))
    _refused_dcp(src, tmp_path, ".metadata", "not a string")


def test_dcp_metadata_of_the_wrong_types_is_one_line(tmp_path):
    src = save_dcp(tmp_path / "dcp")
    edit_metadata(src, lambda m: setattr(m, "storage_data", ["not", "a", "dict"]))
    _refused_dcp(src, tmp_path, ".metadata", "storage_data")
    src = save_dcp(tmp_path / "dcp2")
    edit_metadata(src, lambda m: setattr(m.state_dict_metadata["model.w"].properties, "dtype", "float32"))
    _refused_dcp(src, tmp_path, ".metadata", "model.w")


# ---- streaming reads (interop/torch_zip.py): a hostile zip inside a .pt or .distcp ------------
def _deflate(path: Path) -> None:
    """The same records, compressed (torch.save never compresses; a reader must not inflate)."""
    import zipfile

    with zipfile.ZipFile(path) as zin:
        records = [(i.filename, zin.read(i.filename)) for i in zin.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zout:
        for name, data in records:
            zout.writestr(name, data)


def test_deepspeed_compressed_rank_file_is_refused_naming_it(tmp_path):
    root = ds_copy(tmp_path)
    _deflate(root / TAG / OPTIM1)
    _refused_import(root, tmp_path, OPTIM1, "compressed")


def test_dcp_chunk_with_overlapping_zip_records_is_refused_naming_file_and_key(tmp_path):
    src = save_dcp(tmp_path / "dcp")
    metadata = load_metadata(str(src / ".metadata"))
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "model.w")
    raw = bytearray((src / info.relative_path).read_bytes())
    blob = bytes(raw[info.offset: info.offset + info.length])
    eocd = blob.rfind(b"PK\x05\x06")
    at = int.from_bytes(blob[eocd + 16: eocd + 20], "little")  # the central directory
    while blob[at: at + 4] == b"PK\x01\x02":  # the data/0 entry's sizes: now reaching into the next record
        nlen, xlen, clen = (int.from_bytes(blob[at + i: at + i + 2], "little") for i in (28, 30, 32))
        if blob[at + 46: at + 46 + nlen].endswith(b"data/0"):
            size = int.from_bytes(blob[at + 24: at + 28], "little") + 200
            raw[info.offset + at + 20: info.offset + at + 28] = size.to_bytes(4, "little") * 2
        at += 46 + nlen + xlen + clen
    (src / info.relative_path).write_bytes(bytes(raw))
    _refused_dcp(src, tmp_path, info.relative_path, "model.w", "overlap")


# ---- the same refusals when SRC is on S3 (moto, conftest): the readers go through storage -----------
def _upload_tree(local: Path, url: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        Location(url).write_bytes(path.relative_to(local).as_posix(), path.read_bytes())


@pytest.mark.s3
def test_hostile_pickles_on_s3_are_refused_naming_the_url_and_run_nothing(tmp_path, s3_bucket):
    side = tmp_path / "pwned"
    root = ds_copy(tmp_path, 2)
    torch.save({"optimizer_state_dict": {"x": _evil(side)}}, root / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    _upload_tree(root, f"{s3_bucket}/ds")
    assert_refused(*cli("import", "deepspeed", f"{s3_bucket}/ds", str(tmp_path / "o1")),
                   f"{s3_bucket}/ds/{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt", "refused")

    src = save_dcp(tmp_path / "dcp")
    torch.save({"x": _evil(side)}, tmp_path / "evil.pt")
    (src / "evil.distcp").write_bytes((tmp_path / "evil.pt").read_bytes())

    def edit(m):
        key = next(k for k in m.storage_data if k.fqn == "optim.param_groups.0.lr")
        m.storage_data[key].relative_path, m.storage_data[key].offset = "evil.distcp", 0
        m.storage_data[key].length = (tmp_path / "evil.pt").stat().st_size

    edit_metadata(src, edit)
    _upload_tree(src, f"{s3_bucket}/dcp")
    assert_refused(*cli("import", "dcp", f"{s3_bucket}/dcp", str(tmp_path / "o2")), f"{s3_bucket}/dcp/evil.distcp",
                   "refused")
    (src / ".metadata").write_bytes(pickle.dumps(_evil(side)))  # a hostile .metadata itself
    _upload_tree(src, f"{s3_bucket}/dcp2")
    assert_refused(*cli("import", "dcp", f"{s3_bucket}/dcp2", str(tmp_path / "o3")), f"{s3_bucket}/dcp2/.metadata",
                   "not on the allowlist")
    assert not side.exists() and not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
