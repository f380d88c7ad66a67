"""Imports from s3:// and DCP export to s3:// (issue 18, issue 20), over moto's real HTTP S3
endpoint (conftest): the interop readers reach files only through storage's Location, so a
checkpoint uploaded to S3 imports exactly as its local copy does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.format import open_checkpoint
from zeroshard.interop.dcp_import import read_dcp
from zeroshard.interop.deepspeed_ckpt import read_deepspeed

from checkpoints import read_checkpoint
from interop_model import batch, make_model, make_optimizer

TIER = "default"  # docs/TESTING.md

pytestmark = pytest.mark.s3
FIXTURES = Path(__file__).parent / "data" / "deepspeed"


def _upload(client, local: Path, url: str) -> None:
    """Every file under `local` to the same relative keys under `url` (s3://bucket/prefix)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(local).as_posix()}".lstrip("/")
        client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())


def _same_import(a: str, b: str) -> None:
    """Two imported checkpoints hold the same tensors bit for bit, and the same manifest data."""
    ta, tb = read_checkpoint(a), read_checkpoint(b)
    assert ta.keys() == tb.keys() and len(ta) > 3
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name
    (_, ma), (_, mb) = open_checkpoint(a), open_checkpoint(b)
    assert (ma.step, ma.world_size, ma.optimizer, ma.client_state, ma.aliases, ma.extra["stateful"]) == \
        (mb.step, mb.world_size, mb.optimizer, mb.client_state, mb.aliases, mb.extra["stateful"])
    assert [t.role for t in ma.tensors.values()] == [t.role for t in mb.tensors.values()]


@pytest.mark.parametrize("variant", ["stage3", "stage1", "universal", "hf", "hf_trainer", "hf_trainer_lora"])
def test_deepspeed_from_s3_imports_bit_identical_to_local(tmp_path, s3_bucket, s3_client, variant):
    """A DeepSpeed fixture uploaded to S3: `zeroshard import deepspeed s3://...` writes what the
    local import writes, to a local OUT and to an s3:// OUT; the real Trainer's folders with what
    lies beside the tag folder (scheduler, RNG streams, trainer state) too."""
    src = s3_bucket if variant == "stage1" else f"{s3_bucket}/ds"  # a bucket's root too
    _upload(s3_client, FIXTURES / variant, src)
    runner = CliRunner()
    local = runner.invoke(main, ["import", "deepspeed", str(FIXTURES / variant), str(tmp_path / "local"), "-q"])
    assert local.exit_code == 0, local.output
    remote = runner.invoke(main, ["import", "deepspeed", src, str(tmp_path / "remote"), "-q"])
    assert remote.exit_code == 0, remote.output
    _same_import(str(tmp_path / "local"), str(tmp_path / "remote"))
    assert open_checkpoint(str(tmp_path / "remote"))[1].extra["source"].startswith(("deepspeed:s3://",
                                                                                    "deepspeed-universal:s3://"))
    if variant == "stage3":  # S3 -> S3
        both = runner.invoke(main, ["import", "deepspeed", f"{s3_bucket}/ds", f"{s3_bucket}/zs", "-q"])
        assert both.exit_code == 0, both.output
        _same_import(str(tmp_path / "local"), f"{s3_bucket}/zs")


def _dcp_folder(path: Path) -> None:
    """A real dcp.save of a trained tiny model and its (nested) optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = make_model(0)
    opt = make_optimizer(model.parameters())
    for step in range(2):
        model(*batch(step, 0)).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def test_dcp_from_s3_imports_identically(tmp_path, s3_bucket, s3_client):
    _dcp_folder(tmp_path / "dcp")
    _upload(s3_client, tmp_path / "dcp", f"{s3_bucket}/dcp")
    runner = CliRunner()
    assert runner.invoke(main, ["import", "dcp", str(tmp_path / "dcp"), str(tmp_path / "local"), "-q"]).exit_code == 0
    remote = runner.invoke(main, ["import", "dcp", f"{s3_bucket}/dcp", f"{s3_bucket}/zs", "-q"])
    assert remote.exit_code == 0, remote.output
    _same_import(str(tmp_path / "local"), f"{s3_bucket}/zs")
    # the reader itself, with big tensors read lazily through ranged GETs after it returned
    from zeroshard.interop import dcp_chunks
    from zeroshard.interop.imported import materialize

    old, dcp_chunks.LAZY_BYTES = dcp_chunks.LAZY_BYTES, 1
    try:
        imp, ref = read_dcp(f"{s3_bucket}/dcp"), read_dcp(str(tmp_path / "dcp"))
    finally:
        dcp_chunks.LAZY_BYTES = old
    assert type(imp.params["fc.weight"]).__name__ == "LazyTensor"
    for name, value in ref.params.items():
        assert torch.equal(materialize(imp.params[name]), materialize(value)), name


def test_export_dcp_to_s3_loads_back_with_dcp(tmp_path, s3_bucket):
    """`zeroshard export dcp CKPT s3://...`: `.metadata` last, and dcp.load of a copy gives the weights."""
    import fsspec
    import torch.distributed.checkpoint as dcp

    runner = CliRunner()
    assert runner.invoke(main, ["import", "deepspeed", str(FIXTURES / "stage2"), str(tmp_path / "zs"),
                                "-q"]).exit_code == 0
    result = runner.invoke(main, ["export", "dcp", str(tmp_path / "zs"), f"{s3_bucket}/dcp", "-q"])
    assert result.exit_code == 0, result.output
    fs = fsspec.filesystem("s3")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3_bucket}/dcp", refresh=True))
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    assert not [n for n in names if n.startswith(".zeroshard")]  # no stage, claim or temp file left
    fs.get(f"{s3_bucket}/dcp/", str(tmp_path / "copy"), recursive=True)

    source = read_deepspeed(str(FIXTURES / "stage2"))
    sd = {"model": {k: torch.zeros_like(v) for k, v in make_model(1).state_dict().items()},
          "optim": {"state": {n: {"exp_avg": torch.zeros_like(t)} for n, t in source.params.items()}}}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(tmp_path / "copy")), no_dist=True)
    for name, tensor in source.params.items():
        assert torch.equal(sd["model"][name], tensor), name
        assert torch.equal(sd["optim"]["state"][name]["exp_avg"],
                           source.optimizer_state[name]["exp_avg"].view(tensor.shape)), name
    again = runner.invoke(main, ["export", "dcp", str(tmp_path / "zs"), f"{s3_bucket}/dcp", "-q"])
    assert again.exit_code == 1 and "already exists" in again.output  # never overwritten unasked


def _one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and result.exception is not None
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    return lines[0]


def test_missing_or_cut_s3_objects_are_one_line_errors_naming_them(tmp_path, s3_bucket, s3_client):
    bucket = s3_bucket.removeprefix("s3://")
    _upload(s3_client, FIXTURES / "stage3", f"{s3_bucket}/ds")
    victim = "ds/global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    s3_client.delete_object(Bucket=bucket, Key=victim)  # a rank file missing: the ranks do not add up
    line = _one_line_error(["import", "deepspeed", f"{s3_bucket}/ds", str(tmp_path / "o1")])
    assert f"{s3_bucket}/ds/global_step3:" in line and "2 partitions but 1 files" in line, line

    _upload(s3_client, FIXTURES / "stage3", f"{s3_bucket}/ds2")
    model = "ds2/global_step3/zero_pp_rank_0_mp_rank_00_model_states.pt"
    s3_client.delete_object(Bucket=bucket, Key=model)
    line = _one_line_error(["import", "deepspeed", f"{s3_bucket}/ds2", str(tmp_path / "o2")])
    assert f"{s3_bucket}/{model}" in line and "missing" in line, line

    _dcp_folder(tmp_path / "dcp")
    _upload(s3_client, tmp_path / "dcp", f"{s3_bucket}/dcp")
    data = next(p.name for p in (tmp_path / "dcp").iterdir() if p.name.endswith(".distcp"))
    raw = (tmp_path / "dcp" / data).read_bytes()
    s3_client.put_object(Bucket=bucket, Key=f"dcp/{data}", Body=raw[: len(raw) // 2])  # cut short
    line = _one_line_error(["import", "dcp", f"{s3_bucket}/dcp", str(tmp_path / "o3")])
    assert f"{s3_bucket}/dcp/{data}" in line and "run past its end" in line, line
    s3_client.delete_object(Bucket=bucket, Key=f"dcp/{data}")  # gone: the metadata names it
    line = _one_line_error(["import", "dcp", f"{s3_bucket}/dcp", str(tmp_path / "o4")])
    assert f"{s3_bucket}/dcp/{data}" in line, line

    line = _one_line_error(["import", "dcp", f"{s3_bucket}/nothing-here", str(tmp_path / "o5")])
    assert f"{s3_bucket}/nothing-here" in line and "no such DCP checkpoint folder" in line, line
    with pytest.raises(CheckpointError, match="no such DeepSpeed checkpoint folder"):
        read_deepspeed(f"{s3_bucket}/nothing-here")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


def test_trainer_checkpoint_without_deepspeed_from_s3_imports_bit_identical_to_local(tmp_path, s3_bucket, s3_client):
    """The Trainer's DDP checkpoint (weights read by range from model.safetensors, optimizer.pt,
    config.json, the schedule and RNG streams beside) from S3 writes what its local copy writes."""
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra has it)")
    local_src = FIXTURES / "hf_trainer_ddp" / "checkpoint-3"
    _upload(s3_client, local_src, f"{s3_bucket}/trainer")
    runner = CliRunner()
    local = runner.invoke(main, ["import", "dcp", str(local_src), str(tmp_path / "local"), "-q"])
    assert local.exit_code == 0, local.output
    remote = runner.invoke(main, ["import", "dcp", f"{s3_bucket}/trainer", str(tmp_path / "remote"), "-q"])
    assert remote.exit_code == 0, remote.output
    _same_import(str(tmp_path / "local"), str(tmp_path / "remote"))
    assert open_checkpoint(str(tmp_path / "remote"))[1].extra["source"].startswith("trainer:s3://")
