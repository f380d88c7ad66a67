"""What an overwrite save costs against a fresh save of the same state (checkpointing/save.py:
the stage, then rank 0's swap: old manifest removed, files moved up, old files removed).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tools/bench_overwrite_save.py [--json PATH]

A 10.5M-parameter model, AdamW, stage 2 (121 MB per checkpoint); one warm-up round, then 10 rounds,
each a fresh save into a new tag and an overwrite of tag "t", order alternating, a step between
saves (so no save is a repeat no-op). Reported through tools/benchlib.py: the medians and IQR of
each side and of the paired ratios overwrite / fresh; raw JSON in tools/results/bench_overwrite_save.json.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

import zeroshard  # noqa: E402

ROUNDS, WARMUP = 10, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="/tmp/zeroshard-bench-overwrite", help="where the checkpoints go")
    parser.add_argument("--json", default=None, help="result file (default tools/results/bench_overwrite_save.json)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(10)])  # 10.5M params
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  {"zero_optimization": {"stage": 2}})
    x = torch.randn(4, 1024)

    def step() -> None:  # the state changes between saves: no save is a repeat no-op
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    step()
    engine.save_checkpoint(args.root, tag="t")
    times: dict[str, list[float]] = {"fresh": [], "overwrite": []}
    for i in range(WARMUP + ROUNDS):
        for kind in benchlib.rotated(["fresh", "overwrite"], i):
            dist.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(args.root, tag=f"f{i}" if kind == "fresh" else "t", overwrite=kind == "overwrite")
            dist.barrier()
            if i >= WARMUP:
                times[kind].append(time.perf_counter() - start)
            if kind == "fresh" and engine.rank == 0:
                shutil.rmtree(f"{args.root}/f{i}")
            step()
    if engine.rank == 0:
        shutil.rmtree(args.root)
        rep = benchlib.Report("bench_overwrite_save", vars(args), "CPU, gloo, 2 ranks, local disk, warm page cache; "
                              "121 MB per checkpoint (10.5M params + AdamW, stage 2)")
        rep.runs("fresh", times["fresh"], "save into a new tag")
        rep.runs("overwrite", times["overwrite"], "save over a committed tag (overwrite=True)")
        rep.ratio("overwrite_vs_fresh", "overwrite", "fresh")
        print(rep.table())
        print(f"raw JSON: {rep.finish(args.json)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
