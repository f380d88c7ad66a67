"""What an overwrite save costs against a fresh save of the same state (checkpointing/save.py:
the stage, then rank 0's swap: old manifest removed, files moved up, old files removed).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/bench_overwrite_save.py [ROOT]

A 10.5M-parameter model, AdamW, stage 2 (121 MB per checkpoint); 8 rounds, each a fresh save into a
new tag and an overwrite of tag "t", order alternating, a step between saves (so no save is a repeat
no-op). Prints the medians and the paired ratios overwrite / fresh (CPU, gloo, local disk, warm cache).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

import zeroshard


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(10)])  # 10.5M params
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  {"zero_optimization": {"stage": 2}})
    x = torch.randn(4, 1024)

    def step() -> None:  # the state changes between saves: no save is a repeat no-op
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/zeroshard-bench-overwrite"
    step()
    engine.save_checkpoint(root, tag="t")
    times: dict[str, list[float]] = {"fresh": [], "overwrite": []}
    for i in range(8):
        for kind in ("fresh", "overwrite") if i % 2 == 0 else ("overwrite", "fresh"):
            dist.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(root, tag=f"f{i}" if kind == "fresh" else "t", overwrite=kind == "overwrite")
            dist.barrier()
            times[kind].append(time.perf_counter() - start)
            if kind == "fresh" and engine.rank == 0:
                shutil.rmtree(f"{root}/f{i}")
            step()
    if engine.rank == 0:
        shutil.rmtree(root)
        ratios = sorted(o / f for o, f in zip(times["overwrite"], times["fresh"]))
        print(f"fresh median {statistics.median(times['fresh']):.3f} s, overwrite median "
              f"{statistics.median(times['overwrite']):.3f} s; overwrite / fresh, paired: median "
              f"{statistics.median(ratios):.2f}x (2nd-7th of 8: {ratios[1]:.2f}x - {ratios[-2]:.2f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
