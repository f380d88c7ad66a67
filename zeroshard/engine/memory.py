"""memory_report(): bytes this rank holds, measured from the tensors themselves.

Each storage is counted once (in the first category that reaches it), so a master that aliases
its module parameter (fp32, stage 0) or a gradient view is never double counted. Freed stage-3
parameters have empty storages and count zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from zeroshard.engine.engine_view import EngineView


def report(engine: "EngineView") -> dict[str, int]:
    """Bytes held now, in the ZeRO paper's categories.

    params: module parameters in the compute dtype (stage 3: only units gathered right now; an
    engine without an optimizer: plus its partitions, which stand in for the masters);
    grads: module `.grad` plus the fp32 gradient shards; optimizer: fp32 master chunks plus the
    optimizer's state tensors (the paper's KΨ); buffers: module buffers; comm: gradient buckets,
    stage-3 prefetch buffers and stage 1-2 parameter gathers in flight.
    total = params + grads + optimizer + buffers + comm.
    Informational, not added again: master and optimizer_state (the two parts of `optimizer`:
    fp32 master weights, 0 when they alias the parameters; the optimizer's own state), with
    offload_param the bytes of its partitions (param_offload_host, or param_offload_nvme on
    disk plus param_offload_staging in host buffers) and, on CUDA, cuda_allocated.
    """
    seen: set[tuple[int, str]] = set()

    def count(tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr(), str(t.device))
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total

    module = engine.module
    params = count(p.data for p in module.parameters())
    if engine.optimizer is None:  # an inference engine: its masters are the parameters' partitions
        params += count(s.master for s in engine.shards)
    master = count(s.master for s in engine.shards)
    grads = count([p.grad for p in module.parameters()] + [s.master.grad for s in engine.shards])
    opt_state = (count(v for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
                 if engine.optimizer is not None else 0)
    out = {
        "params": params,
        "grads": grads,
        "optimizer": master + opt_state,
        "buffers": count(module.buffers()),
        "comm": engine.reducer.held_bytes()
        + (engine.stage3_scheduler.inflight_bytes() if engine.stage3_scheduler is not None else 0)
        + (engine.param_refresh.inflight_bytes() if engine.param_refresh is not None else 0),
    }
    out["total"] = sum(out.values())
    out["master"] = master
    out["optimizer_state"] = opt_state
    out.update(engine.param_tier.report())  # offload_param: param_offload_host / _nvme / _staging
    if engine.device.type == "cuda":
        out["cuda_allocated"] = torch.cuda.memory_allocated(engine.device)
    return out
