"""The training core: ZeRO stages 0-3 on torch.distributed.

    import zeroshard
    engine = zeroshard.initialize(model=model, optimizer=opt, config=cfg)
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()

Files, one concern each:
  config.py       ZeroConfig dataclasses; DeepSpeed-style dict/JSON parsing and validation
  layout.py       ParamShard/ShardInfo: each parameter's owned range (zeroshard.partition) and
                  fp32 master chunk; row layout of collective buffers
  collectives.py  process-group set-up, bucketed parameter all-gathers; every collective issued
  comm_ledger.py  what those collectives move (comm_report(): bytes per step against 2Ψ / 3Ψ)
  reducer.py      gradient buckets (all-reduce / reduce-scatter into fp32 gradient shards)
  stage3.py       stage-3 units, their gather/free state and every forward/backward hook
  precision.py    compute-dtype casting, fp16 dynamic loss scaling
  optim.py        taking over the user's optimizer (elementwise only) over the fp32 shards
  meta_init.py    zero_init(); materializing a meta-built model module by module
  offload.py      offload_optimizer: where the fp32 masters (and optimizer state) live
  param_offload.py offload_param (stage 3): the partitions the gathers read, in host memory or files
  param_gather.py stages 1-2: updated params gathered asynchronously, waited for per module
  engine.py       ZeroEngine (forward/backward/step) and initialize()
  contract.py     EngineState: what a checkpoint holds of an engine, as typed values
  state.py        checkpoint_state/restore, named_shards/load_shards, full state dicts
  memory.py       memory_report()

This package never imports zeroshard.checkpointing: checkpoints reach the engine only through
`checkpoint_state()` / `restore()`; `zeroshard.initialize` (zeroshard/training.py) adds the
save_checkpoint/load_checkpoint conveniences on top.

Checkpoint interface. `engine.named_shards()` yields `(name, ShardInfo)` per unique parameter in
`model.named_parameters()` order (tied parameters once, under their first name). A ShardInfo has
`name, shape, dtype` (the parameter's dtype before the engine cast it), `start, end` (the owned
flat range: `zeroshard.partition.shard_range(numel, world_size, rank)`), `chunk`
(`chunk_size(numel, world_size)`), `world_size` (the partition's: 1 at stage 0, where every rank
holds everything and only rank 0 need save), `requires_grad`, `master` (live fp32 tensor of
`chunk` elements; `fragment` = its first `end - start`, the real ones) and `optimizer_state`
(live dict: tensors with dim >= 1 are per-element, `chunk` elements like the master; 0-dim
tensors and numbers such as Adam's `step` are scalar; see `tensor_state` / `scalar_state`).
`engine.load_shards({name: {"fragment": t, "optimizer_state": {...}}})` assigns them back
(fragments of `end - start` or `chunk` elements; a collective at stages 1-2: all ranks call it).
`engine.checkpoint_state()` returns all of it at once, with buffers, tied-parameter aliases,
counters, the loss scaler and the optimizer's param groups by member name, as an EngineState
(contract.py); `engine.restore(state)` applies one. `engine.full_state_dict()` gathers
full fp32 weights to rank 0; `engine.load_full_state_dict(sd)` scatters a full one.
"""

from zeroshard.engine.config import ConfigError, ZeroConfig
from zeroshard.engine.contract import BufferState, Counters, EngineState, ParamGroup
from zeroshard.engine.engine import ZeroEngine, initialize
from zeroshard.engine.layout import ShardInfo
from zeroshard.engine.meta_init import zero_init

__all__ = ["initialize", "zero_init", "ZeroConfig", "ZeroEngine", "ShardInfo", "ConfigError", "EngineState",
           "BufferState", "Counters", "ParamGroup"]
