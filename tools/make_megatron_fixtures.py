"""Generate tests/data/megatron: a checkpoint written by Megatron-Core 0.19.2's own
`dist_checkpointing.save` in its default `torch_dist` format (what NeMo and Megatron-LM write).

Megatron-Core goes into a folder outside the repo, without its dependencies (it declares Python
>= 3.12 and imports only packages the dev venv has; torch stays the venv's, never resolved):

    .venv/bin/python -m pip install --no-deps --ignore-requires-python --target /tmp/mcore \
        megatron-core==0.19.2
    PYTHONPATH=/tmp/mcore .venv/bin/python tools/make_megatron_fixtures.py [OUT_DIR]

Two gloo processes build a tiny GPTModel (2 layers, hidden 32, 4 heads, vocab 64, local
non-Transformer-Engine layer spec, weights initialised on the CPU) at tensor parallel 2 and save
{"model": model.sharded_state_dict(), "iteration", "checkpoint_version"} as Megatron-LM's
save_checkpoint lays it out (without its pickled `args` Namespace) into OUT_DIR/tp2.
reference.safetensors holds the model's own state dict with each tensor-parallel parameter
all-gathered along the `partition_dim` Megatron marks it with (per-layer names
`decoder.layers.{i}.…`, as the live module names them, with the layer spec's own
sharded_state_dict_keys_map applied: the checkpoint saves the norms under Transformer Engine's
fused names); expected.json the iteration and versions.

On a CUDA-less torch three things are stood in, none of which touches what is written:
`torch.cuda.current_device` / `torch.cuda.synchronize` (called by the save's bookkeeping), and
megatron's MoE paged-stash Triton kernels module (imported at package import; this model has no
MoE). Megatron's distributed optimizer needs CUDA, so the fixture holds model weights only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
WORLD, TP, ITERATION, CHECKPOINT_VERSION = 2, 2, 7, 3.0
LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 32, 4, 64, 16


def _stand_ins() -> None:
    """Let megatron import and save on a CPU-only torch (see the module docstring)."""
    stash = types.ModuleType("megatron.core.transformer.moe.ops.paged_stash")
    stash.GLOBAL_BLOCK_SIZE = 1024
    stash.paged_stash_copy_kernel = stash.paged_stash_pop_kernel = None
    sys.modules[stash.__name__] = stash
    torch.cuda.current_device = lambda: "cpu"  # used as a tensor device
    torch.cuda.synchronize = lambda *a, **k: None


def _model():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, tensor_model_parallel_size=TP,
                               pipeline_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=VOCAB, max_sequence_length=SEQ)


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with tensor-parallel parameters joined along their partition_dim."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    params = dict(model.named_parameters())
    out = {}
    for name, value in model.state_dict().items():
        if not torch.is_tensor(value):
            continue  # _extra_state (None / BytesIO)
        p = params.get(name)
        if p is not None and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(value) for _ in range(TP)]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts, dim=p.partition_dim)
        out[name] = value.detach().clone().contiguous()
    # the names the checkpoint gives them: the local layer spec's norms are modules of their own
    # (input_layernorm), saved under Transformer Engine's fused names (linear_qkv.layer_norm_weight)
    for i, layer in enumerate(model.decoder.layers):
        for old, new in layer.submodules_config.sharded_state_dict_keys_map.items():
            prefix = f"decoder.layers.{i}."
            for name in [n for n in out if n.startswith(prefix + old)]:
                out[prefix + new + name[len(prefix + old):]] = out.pop(name)
    return out


def _rank(rank: int, port: int, out: str) -> None:
    _stand_ins()
    from megatron.core import dist_checkpointing, parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    torch.manual_seed(1234)
    model = _model()
    reference = _gathered(model)
    state = {"model": model.sharded_state_dict(), "iteration": ITERATION, "checkpoint_version": CHECKPOINT_VERSION}
    target = Path(out, "tp2")
    if rank == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, str(target))
    if rank == 0:
        import megatron.core
        from safetensors.torch import save_file

        save_file(reference, str(Path(out, "reference.safetensors")))
        expected = {"megatron_core": megatron.core.__version__, "torch": torch.__version__.split("+")[0],
                    "tensor_parallel": TP, "iteration": ITERATION, "checkpoint_version": CHECKPOINT_VERSION,
                    "layers": LAYERS}
        Path(out, "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "tests" / "data" / "megatron")
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(out)), nprocs=WORLD)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
