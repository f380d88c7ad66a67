"""DCP (FSDP2) interop: `zeroshard import dcp` of a checkpoint FSDP2 wrote at world 2 on gloo
resumes with FSDP2's own next losses; `zeroshard export dcp` goes back, and FSDP2 resumes from
the export with the source's next losses; hostile metadata pickles never run."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch_versions import fsdp2_reference

from zeroshard.cli import main
from zeroshard.errors import CheckpointError
from zeroshard.interop.dcp_import import read_dcp
from zeroshard.interop.imported import LazyTensor

from distributed import run_ranks
from interop_model import batch, make_model, make_optimizer, mean_over_ranks, zeroshard_resumed_losses

TIER = "default"  # docs/TESTING.md

FIXTURES = Path(__file__).parent / "data" / "deepspeed"


def _fsdp2(rank, world_size, save=None, load=None, steps=(), clip=0.0, writer=None):
    """FSDP2 on CPU/gloo: optionally dcp.load a checkpoint, train `steps`, optionally dcp.save
    (with a FileSystemWriter of these `writer` options)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(0 if load is None else 1)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = make_optimizer(model.parameters())
    if load is not None:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=load)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    losses = []
    for step in steps:
        loss = model(*batch(step, rank))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
        if save is not None and step == 2:
            msd, osd = get_state_dict(model, opt)
            if writer is None:
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=save)
            else:
                dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(save, **writer))
    return losses


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp") / "step3"
    losses = run_ranks(_fsdp2, 2, save=str(folder), steps=range(6), timeout=180)[0]
    return folder, losses[3:]


@fsdp2_reference
def test_import_dcp_resumes_like_fsdp2(tmp_path, fsdp_checkpoint):
    folder, fsdp_next = fsdp_checkpoint
    out = tmp_path / "imported"
    result = CliRunner().invoke(main, ["import", "dcp", str(folder), str(out), "--world", "2", "-q"])
    assert result.exit_code == 0, result.output
    for stage in (3, 1):
        ours = run_ranks(zeroshard_resumed_losses, 2, path=str(out), stage=stage, clip=0.0, init_process_group=False)[0]
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(ours, fsdp_next)), (stage, ours, fsdp_next)
    imp = read_dcp(str(folder))
    assert imp.aliases == {"head.weight": "emb.weight"} and list(imp.buffers) == ["scale"]
    assert imp.global_steps == 3 and imp.param_groups[0]["params"][0] == "emb.weight"


def test_dcp_writer_options_import_the_same_tensors(tmp_path, fsdp_checkpoint):
    """A file per tensor (single_file_per_rank=False), several writer threads: other files, the same
    checkpoint, bit for bit."""
    folder, _ = fsdp_checkpoint
    base = read_dcp(str(folder))
    for options in ({"single_file_per_rank": False}, {"thread_count": 3, "sync_files": False}):
        save = tmp_path / "_".join(map(str, options))
        run_ranks(_fsdp2, 2, save=str(save), steps=range(3), writer=options, timeout=180)
        assert len(list(save.glob("*.distcp"))) > 2  # not the default layout: one file per rank
        got = read_dcp(str(save))
        assert sorted(got.params) == sorted(base.params) and got.aliases == base.aliases
        def full(value):
            return value.materialize() if isinstance(value, LazyTensor) else torch.as_tensor(value)

        for name, tensor in base.params.items():
            assert torch.equal(full(got.params[name]), full(tensor)), (options, name)
        for name, state in base.optimizer_state.items():
            for key, value in state.items():
                assert torch.equal(full(got.optimizer_state[name][key]), full(value)), (options, name, key)


def test_export_dcp_goes_back_to_fsdp2(tmp_path):
    """DeepSpeed -> zeroshard -> DCP -> FSDP2: FSDP2 continues exactly as DeepSpeed did."""
    expected = json.loads((FIXTURES / "stage2" / "expected.json").read_text())
    runner = CliRunner()
    assert runner.invoke(main, ["import", "deepspeed", str(FIXTURES / "stage2"), str(tmp_path / "zs"),
                                "-q"]).exit_code == 0
    result = runner.invoke(main, ["export", "dcp", str(tmp_path / "zs"), str(tmp_path / "dcp"), "-q"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "dcp" / ".metadata").exists()
    again = runner.invoke(main, ["export", "dcp", str(tmp_path / "zs"), str(tmp_path / "dcp"), "-q"])
    assert again.exit_code == 1 and "already exists" in again.output  # never overwritten unasked

    # a plain, process-group-free DCP load sees the same values
    import torch.distributed.checkpoint as dcp

    from zeroshard.interop.deepspeed_ckpt import read_deepspeed

    source = read_deepspeed(str(FIXTURES / "stage2"))
    model = make_model(1).state_dict()
    state = {n: {"exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t), "step": torch.tensor(0.0)}
             for n, t in source.params.items()}
    sd = {"model": {k: torch.zeros_like(v) for k, v in model.items()}, "optim": {"state": state}}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    for name, tensor in source.params.items():
        assert torch.equal(sd["model"][name], tensor)
        assert torch.equal(sd["optim"]["state"][name]["exp_avg"],
                           source.optimizer_state[name]["exp_avg"].view(tensor.shape))
        assert sd["optim"]["state"][name]["step"].item() == 3
    assert torch.equal(sd["model"]["head.weight"], source.params["emb.weight"])
    assert torch.equal(sd["model"]["scale"], torch.full((5,), 0.5))

    losses = run_ranks(_fsdp2, 2, load=str(tmp_path / "dcp"), steps=(3, 4, 5), clip=1.0, timeout=180)[0]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, expected["losses_resumed"])), \
        (losses, expected["losses_resumed"])


def test_export_dcp_carries_the_schedule_and_client_state_and_names_per_rank_state(tmp_path):
    """What a script adds to the dict it gives dcp.load ({"lr_scheduler": sched.state_dict()})
    comes back as saved; the per-rank RNG streams, which a full-state export cannot hold, are named."""
    import torch.distributed.checkpoint as dcp

    legacy = Path(__file__).parent / "data" / "engine-1.1-rng"  # StepLR, client state, RNG per rank
    result = CliRunner().invoke(main, ["export", "dcp", str(legacy / "step-2"), str(tmp_path / "dcp"), "-q"])
    assert result.exit_code == 0, result.output
    assert "also 'lr_scheduler', 'client_state'" in result.output, result.output
    assert "per-rank state (RNG streams) of 2 rank(s) is not exported" in result.output, result.output
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1)], lr=0.01), step_size=1, gamma=0.5)
    sd = {"lr_scheduler": sched.state_dict(), "client_state": {"next_step": 0}}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    sched.load_state_dict(sd["lr_scheduler"])
    assert sched.state_dict() == json.loads((legacy / "expected-rank0.json").read_text())["scheduler"]
    assert sd["client_state"] == {"next_step": 2}

    # an import's schedule (Accelerate's scheduler.bin) goes on out the other side
    runner = CliRunner()
    assert runner.invoke(main, ["import", "deepspeed", str(FIXTURES / "accelerate_lambdalr"), str(tmp_path / "zs"),
                                "-q"]).exit_code == 0
    result = runner.invoke(main, ["export", "dcp", str(tmp_path / "zs"), str(tmp_path / "dcp2"), "-q"])
    assert result.exit_code == 0 and "not exported" not in result.output, result.output
    sd = {"lr_scheduler": {"last_epoch": -1, "_last_lr": [0.0]}}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp2")), no_dist=True)
    assert sd["lr_scheduler"]["last_epoch"] == 3 and sd["lr_scheduler"]["_last_lr"] == [0.0025]


class _Evil:
    def __init__(self, side: Path):
        self.side = side

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.side}",))


def test_hostile_metadata_is_refused_and_never_runs(tmp_path):
    folder, side = tmp_path / "evil", tmp_path / "pwned"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil(side)))
    with pytest.raises(CheckpointError) as err:
        read_dcp(str(folder))
    assert ".metadata" in str(err.value) and "refused" in str(err.value) and "\n" not in str(err.value)
    result = CliRunner().invoke(main, ["import", "dcp", str(folder), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert not side.exists()


def test_metadata_state_naming_a_dunder_is_refused(tmp_path):
    """DCP's classes are read as stand-ins (dcp_metadata._Record); a state that would plant
    `__setstate__` on one, so a second BUILD calls what the pickle chose, is refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    planted = Metadata(state_dict_metadata={})
    planted.__dict__["__setstate__"] = "x"  # pickled with the fields: NEWOBJ Metadata, BUILD {...}
    folder = tmp_path / "planted"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(planted))
    with pytest.raises(CheckpointError, match="refused to unpickle: Metadata: '__setstate__' is not a field name"):
        read_dcp(str(folder))


def test_hostile_chunk_bytes_are_refused_and_never_run(tmp_path):
    """The metadata is fine (a one-element model tensor) but its chunk's bytes are a pickle that
    would call os.system."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder, side = tmp_path / "evil", tmp_path / "pwned"
    folder.mkdir()
    blob = io.BytesIO()
    torch.save(_Evil(side), blob)
    (folder / "__0_0.distcp").write_bytes(blob.getvalue())
    one = torch.Size([1])
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), one,
                                  [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=one)])
    metadata = Metadata(state_dict_metadata={"model.x": entry}, planner_data={"model.x": ("model", "x")},
                        storage_data={MetadataIndex("model.x", torch.Size([0])):
                                      _StorageInfo("__0_0.distcp", 0, len(blob.getvalue()))})
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError) as err:
        read_dcp(str(folder))
    assert "__0_0.distcp" in str(err.value) and "model.x" in str(err.value) and "\n" not in str(err.value)
    assert not side.exists()
