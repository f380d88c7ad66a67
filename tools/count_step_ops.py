"""Count the torch operations one training step dispatches (zeroshard stage N, or DDP), by kind.

    python tools/count_step_ops.py --stage 1            # the sample GPT, 12 layers, bf16, one rank
    python tools/count_step_ops.py --ddp                # DDP + AdamW under autocast, for comparison

On a GPU each non-view operation is (at least) one kernel launch, and a small model's step is
bound by those launches, not by arithmetic; this counts them on the CPU, where no GPU is needed.
Views (slice, view, detach, ...) cost dispatcher time but launch nothing. The optimizer's own
operations are included: torch's AdamW runs per tensor on the CPU and as foreach on CUDA, so the
CPU count overstates its share. Deterministic: no repeats needed.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VIEWS = {"aten.slice.Tensor", "aten.view.default", "aten.detach.default", "aten.t.default",
         "aten.as_strided.default", "aten.select.int", "aten.unsqueeze.default", "aten.expand.default",
         "aten._unsafe_view.default", "aten.transpose.int", "aten.alias.default", "aten.reshape.default",
         "aten.permute.default", "aten.split.Tensor", "aten.squeeze.dim", "aten.unbind.int",
         "aten._local_scalar_dense.default"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, default=1, choices=[0, 1, 2, 3])
    p.add_argument("--ddp", action="store_true", help="count DDP + AdamW (autocast bf16) instead")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--top", type=int, default=10, help="print the most frequent operations")
    args = p.parse_args(argv)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import zeroshard
    from samples.gpt import GPT, GPTConfig, lm_loss

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    dist.init_process_group("gloo")
    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=args.layers, n_head=4, n_embd=64)
    x, y = torch.randint(0, 96, (2, 32)), torch.randint(0, 96, (2, 32))
    torch.manual_seed(0)
    model = GPT(cfg)
    if args.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(net(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
    else:
        engine = zeroshard.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config={
            "zero_optimization": {"stage": args.stage,
                                  **({"stage3_unit_classes": ["Block"]} if args.stage == 3 else {})},
            "bf16": {"enabled": True}, "gradient_clipping": 1.0})

        def step() -> None:
            engine.backward(lm_loss(engine(x), y))
            engine.step()

    for _ in range(3):  # warm: buckets rebuilt in arrival order, optimizer state allocated
        step()
    count = Count()
    with count:
        step()
    tensors = sum(1 for _ in model.parameters())
    nonview = sum(n for op, n in count.ops.items() if op not in VIEWS)
    what = "DDP" if args.ddp else f"zeroshard stage {args.stage}"
    print(f"{what}, sample GPT {args.layers} layers ({tensors} parameter tensors), one rank: "
          f"{sum(count.ops.values())} operations per step, {nonview} of them not views")
    for op, n in count.ops.most_common(args.top):
        print(f"  {n:6d} {op}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
