"""What torch.distributed writes beyond FSDP2 alone, each written by torch itself on gloo:

 - tensor parallelism (`parallelize_module` with ColwiseParallel / RowwiseParallel: pieces cut
   along dimension 0 and dimension 1) and FSDP2 over it on a 2 x 2 mesh (FSDP's `_StridedShard`
   of a dimension TP already cut): `zeroshard import dcp` gives the full tensors, bit for bit,
   and `export dcp` goes back into the same 2-D model through `dcp.load`;
 - DCP's HuggingFaceStorageWriter: with `save_distributed=True` each rank writes its own pieces
   to `shard-R-model-...safetensors`, which `zeroshard shard` refuses in one line naming the
   file (it took them for full tensors and exited 0 with half a model); a rank-0 save and DCP's
   own consolidation of the pieces are full models and shard exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from zeroshard import open_tensors
from zeroshard.cli import main

from distributed import run_ranks
from interop_model import make_model

TIER = "mixed"  # docs/TESTING.md

VOCAB, DIM, HIDDEN = 17, 8, 12  # an odd vocabulary: FSDP pieces of unequal length (TP needs even ones)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


def _parallel(world_size: int, seed: int):
    """The MLP with `up` cut column-wise and `down` row-wise over `tp` ranks; on 4 ranks, FSDP2
    over a 2 x 2 mesh on top."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = MLP()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if world_size == 2:
        parallelize_module(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), plan)
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
    return model


def _full(value) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _full_state(msd: dict, osd: dict) -> dict[str, torch.Tensor]:
    """Weights and per-element optimizer state in full, under open_tensors' names."""
    full = {name: _full(v).clone() for name, v in msd.items()}
    full.update({f"optimizer/{k}/{name}": _full(v).clone() for name, state in osd["state"].items()
                 for k, v in state.items() if v.dim() > 0})
    return full


def _save_parallel(rank: int, world_size: int, out: str) -> dict:
    """Two AdamW steps, then dcp.save of {"model", "optim"}; the full tensors and the placements."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _parallel(world_size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, VOCAB, (4, 6), generator=g), torch.randint(0, VOCAB, (4, 6), generator=g)
    for _ in range(2):  # the same batch on every rank: TP ranks share their data
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    placements = {name: repr(getattr(v, "placements", None)) for name, v in msd.items()}
    return {"tensors": _full_state(msd, osd), "placements": placements}


def _load_exported(rank: int, world_size: int, path: str) -> dict:
    """dcp.load of an export into a freshly built (other seed) 2-D model, as a resume does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _parallel(world_size, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)).backward()
    opt.step()  # Adam state exists, so there is something for the load to overwrite
    opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full_state(*get_state_dict(model, opt))


def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["tp", "fsdp-tp-2d"])
def parallel_save(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.node.name.replace("/", "_")) / "dcp"
    return request.param, out, run_ranks(_save_parallel, request.param, out=str(out), timeout=240)[0]


def test_tensor_parallel_pieces_import_bit_exact(tmp_path, parallel_save):
    world, src, saved = parallel_save
    placements = " ".join(saved["placements"].values())
    assert "Shard(dim=1)" in placements  # RowwiseParallel's: pieces across the rows
    if world == 4:
        assert "_StridedShard" in placements  # FSDP2 cutting the dimension TP already cut
    _cli("import", "dcp", str(src), str(tmp_path / "zs"), "--world", "2", "-q")
    tensors = open_tensors(str(tmp_path / "zs"), roles=None)
    assert set(tensors) == set(saved["tensors"])
    for name, expected in saved["tensors"].items():
        assert torch.equal(tensors[name].reshape(expected.shape), expected), name


@pytest.mark.slow
@pytest.mark.parametrize("parallel_save", [4], indirect=True, ids=["fsdp-tp-2d"])  # covers the 1-D model too
def test_export_goes_back_into_the_2d_model(tmp_path, parallel_save):
    world, src, saved = parallel_save
    _cli("import", "dcp", str(src), str(tmp_path / "zs"), "--world", "3", "-q")  # another world size between
    _cli("export", "dcp", str(tmp_path / "zs"), str(tmp_path / "back"), "-q")
    loaded = run_ranks(_load_exported, 4, path=str(tmp_path / "back"), timeout=240)[0]
    assert set(loaded) == set(saved["tensors"])
    for name, expected in saved["tensors"].items():
        assert torch.equal(loaded[name], expected), name


# ---- DCP's HuggingFaceStorageWriter ----------------------------------------------------------
def _save_hf_pieces(rank: int, world_size: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(0)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    sd = model.state_dict()
    sd.pop("head.weight")  # tied to emb.weight: safetensors refuses shared storage
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))


def _model_tensors() -> dict[str, torch.Tensor]:
    sd = make_model(0).state_dict()
    sd.pop("head.weight")
    return sd


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the rank-0 save, in this process
def test_dcp_safetensors_pieces_are_refused_and_full_saves_shard_exactly(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    consolidate = pytest.importorskip("torch.distributed.checkpoint._consolidate_hf_safetensors",
                                      reason="DCP's HF consolidation is newer than this torch")
    consolidate_safetensors_files = consolidate.consolidate_safetensors_files
    pieces = tmp_path / "pieces"
    run_ranks(_save_hf_pieces, 2, out=str(pieces), timeout=240)
    rank_files = sorted(p.name for p in pieces.glob("*.safetensors"))
    assert rank_files == ["shard-00001-model-00001-of-00001.safetensors",
                          "shard-00002-model-00001-of-00001.safetensors"]
    # rank 0's file alone: every offset 0, every tensor's first half; only DCP's file name tells
    for src in [pieces, *(pieces / name for name in rank_files)]:
        result = CliRunner().invoke(main, ["shard", str(src), str(tmp_path / "out"), "--world", "2", "-q"])
        assert result.exit_code == 1, result.output
        assert "holds one rank's pieces of DCP-sharded tensors" in result.output, result.output
        assert not (tmp_path / "out").exists()
    renamed = tmp_path / "renamed.safetensors"  # the second rank's file under another name: its offsets tell
    renamed.write_bytes((pieces / rank_files[1]).read_bytes())
    result = CliRunner().invoke(main, ["shard", str(renamed), str(tmp_path / "out"), "--world", "2", "-q"])
    assert result.exit_code == 1 and "pieces of DCP-sharded tensors" in result.output, result.output

    # full models DCP writes: a rank-0 save (its header has DCP's offsets, all 0) and its consolidation
    rank0 = tmp_path / "rank0"
    dcp.save(_model_tensors(), storage_writer=HuggingFaceStorageWriter(str(rank0)))
    assert "DCP_SHARDING_INFO" in (rank0 / "model-00001-of-00001.safetensors").read_bytes()[:4096].decode("latin-1")
    consolidated = tmp_path / "consolidated"
    consolidated.mkdir()
    consolidate_safetensors_files(str(pieces), str(consolidated),
                                  fqn_to_index_mapping=dict.fromkeys(_model_tensors(), 1))
    for full in (rank0, consolidated):
        _cli("shard", str(full), str(tmp_path / f"{full.name}-zs"), "--world", "3", "-q")
        tensors = open_tensors(str(tmp_path / f"{full.name}-zs"))
        expected = _model_tensors()
        assert set(tensors) == set(expected)
        assert all(torch.equal(tensors[n].reshape(t.shape), t) for n, t in expected.items())
    assert json.loads((consolidated / "model.safetensors.index.json").read_text())["weight_map"]
    assert Path(pieces).is_dir()
