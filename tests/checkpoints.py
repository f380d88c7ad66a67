"""Test helpers: models and optimizer-bearing checkpoints built through the public format API,
and reading a whole checkpoint back for exact comparison."""

from __future__ import annotations

import uuid

import torch
from safetensors.torch import save_file

from zeroshard.format import (
    CheckpointReader,
    TensorSpec,
    build_manifest,
    open_checkpoint,
    rank_contents,
    write_rank_file,
)
from zeroshard.format.output import output_transaction, prepare_output
from zeroshard.storage import Location, dtype_name


def odd_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of every kind that trips up sharding: dtypes, 0-d, odd and tiny shapes."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(37, 11, generator=g),
        "block.0.attn.weight": torch.randn(13, 7, generator=g).bfloat16(),
        "block.0.attn.bias": torch.randn(5, generator=g).half(),
        "block.0.norm.scale": torch.tensor(1.25),
        "block.0.count": torch.arange(17, dtype=torch.int64),
        "block.0.flag": torch.tensor([True, False, True]),
        "block.0.tiny": torch.randn(1, generator=g),
        "head.weight": torch.randn(3, 4, 5, generator=g).double(),
        "empty": torch.zeros(0, 4),
    }


def save_model(tensors: dict[str, torch.Tensor], path) -> None:
    save_file(tensors, str(path))


def training_state(seed: int = 0) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
    """A checkpoint's worth of state: params, a buffer, Adam moments and step, per-rank RNG."""
    model = {k: v for k, v in odd_model(seed).items() if v.is_floating_point()}
    specs, data = [], {}
    for name, value in model.items():
        specs.append(TensorSpec(name, "param", dtype_name(value.dtype), tuple(value.shape),
                                "flat" if value.dim() else "whole"))
        data[name] = value
        for state in ("exp_avg", "exp_avg_sq"):
            key = f"optimizer/{state}/{name}"
            specs.append(TensorSpec(key, "optimizer", "F32", tuple(value.shape), "flat" if value.dim() else "whole",
                                    param=name, state=state))
            data[key] = torch.randn(value.shape, generator=torch.Generator().manual_seed(len(key)))
        key = f"optimizer/step/{name}"
        specs.append(TensorSpec(key, "optimizer", "F32", (), "whole", param=name, state="step"))
        data[key] = torch.tensor(7.0)
    specs.append(TensorSpec("running_mean", "buffer", "F32", (9,), "whole"))
    data["running_mean"] = torch.linspace(0, 1, 9)
    return specs, data


def write_checkpoint(url: str, specs: list[TensorSpec], data: dict[str, torch.Tensor], world_size: int,
                     rng: bool = True, **fields) -> None:
    """Write `data` as a world_size-rank checkpoint with the format's writer (as a training run would)."""
    specs = list(specs)
    data = dict(data)
    if rng:
        for rank in range(world_size):
            name = f"rng/rank-{rank:05d}/cpu"
            specs.append(TensorSpec(name, "extra", "U8", (16,), "local", owner=rank))
            data[name] = torch.full((16,), rank, dtype=torch.uint8)
    _write(Location(url), specs, data, world_size, fields)


@output_transaction  # a failure leaves no claim or stage behind
def _write(location: Location, specs: list[TensorSpec], data: dict[str, torch.Tensor], world_size: int,
           fields: dict) -> None:
    output = prepare_output(location, overwrite=False)  # identity, claim, stage: as the toolkit writes
    checkpoint_id = uuid.uuid4().hex

    def fill(spec, start, end, write):
        write(memoryview(data[spec.name].reshape(-1)[start:end].contiguous().view(torch.uint8).numpy()))

    results = [write_rank_file(output.stage, checkpoint_id, r, world_size, rank_contents(specs, world_size, r), fill)
               for r in range(world_size)]
    fields.setdefault("optimizer", {"class": "torch.optim.AdamW", "param_groups": [{"lr": 1e-3, "params": []}]})
    manifest = build_manifest(specs, world_size, results, checkpoint_id, zero_stage=3, step=7, tag="step-7",
                              client_state={"epoch": 1, "offset": 123}, **fields)
    output.commit_checkpoint(manifest)


def read_checkpoint(url: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, global and in its real shape."""
    location, manifest = open_checkpoint(url)
    with CheckpointReader(location, manifest) as reader:
        return {name: reader.read_flat(t).reshape(t.shape) for name, t in manifest.tensors.items()}
