"""torchtitan 0.3.0's llama3 shrunk for the interval-checkpoint fixture (tests/data/torchtitan).

Shared by tools/make_torchtitan_fixtures.py (trains it with torchtitan's own optimizer, LR
schedule and CheckpointManager) and tests/test_import_torchtitan_interval.py (resumes the import
under zeroshard's engine with the same model class). The debug model's layers with fused QKV,
as small as its config allows: dim 16, 4 heads over 2 KV heads (head_dim 4), 2 layers, a
32-token vocabulary. Data is arithmetic, so it is the same on every machine.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch

# tools/dev.sh test installs torchtitan without its dependencies in a folder of its own
TORCHTITAN = os.environ.get("ZEROSHARD_TORCHTITAN_PATH", os.path.join(sys.prefix, "torchtitan-0.3.0"))
VERSION = "0.3.0"
DIM, N_HEADS, N_KV_HEADS, N_LAYERS, VOCAB = 16, 4, 2, 2, 32
HEAD_DIM = DIM // N_HEADS
SEQ, MICRO_BATCH = 8, 2
LR, WARMUP, DECAY_RATIO, TOTAL_STEPS = 8e-3, 2, 0.8, 10  # the debug config's schedule, lr raised to move
_EP_KERNELS = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
               "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
               "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def import_torchtitan() -> None:
    """Put torchtitan on sys.path. Its model package imports the MoE expert-parallel triton kernels
    at import time; a dense llama3 never calls them and triton is not installed on CPU machines,
    so that one module is stood in for by names that fail if called."""
    if TORCHTITAN not in sys.path:
        sys.path.insert(0, TORCHTITAN)
    name = "torchtitan.distributed.minimal_async_ep.kernels"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        for kernel in _EP_KERNELS:
            setattr(stub, kernel, None)
        sys.modules[name] = stub


def make_model(seed: int) -> torch.nn.Module:
    """torchtitan's Llama3Model with the debug model's layers (fused QKV), shrunk; initialised by
    torchtitan's own init_states. Attention is torchtitan's causal SDPA: its FlexAttention (the
    debug model's) has no backward on the CPU."""
    import_torchtitan()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    layers = _build_llama3_layers(fuse_qkv=True, n_layers=N_LAYERS, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS,
                                  hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=16),
                                  rope=ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=500000,
                                                          scaling="llama"),
                                  attn_backend="flex")
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)))
    torch.manual_seed(seed)
    model = config.build()
    model.init_states()
    return model


def optimizer_config() -> Any:
    """torchtitan's default AdamW (the debug config's), for-loop: fused is CUDA only."""
    import_torchtitan()
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    kwargs = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    return OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                                                     optimizer_kwargs=kwargs)],
                                      implementation="for-loop")


def lr_schedulers(optimizers: Any) -> Any:
    """torchtitan's LRSchedulersContainer with the debug config's warmup-stable-decay schedule;
    `optimizers`: an OptimizersContainer, or a list of torch optimizers."""
    import_torchtitan()
    from torchtitan.components.optimizer import LRSchedulersContainer

    return LRSchedulersContainer.Config(warmup_steps=WARMUP, decay_ratio=DECAY_RATIO, decay_type="linear",
                                        min_lr_factor=0.0).build(optimizers=optimizers, training_steps=TOTAL_STEPS)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels of data-parallel rank `rank` at optimizer step `step` (0-based)."""
    i = torch.arange(MICRO_BATCH * (SEQ + 1)).reshape(MICRO_BATCH, SEQ + 1)
    tokens = (i * 5 + step * 7 + rank * 3 + (i * i) % 11) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """torchtitan's cross_entropy_loss (a sum) over this rank's tokens, divided by their number."""
    from torchtitan.components.loss import cross_entropy_loss

    inputs, labels = batch(step, rank)
    return cross_entropy_loss(model(inputs), labels) / labels.numel()


def mean_over_ranks(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()
