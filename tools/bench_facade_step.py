"""Two A/Bs of the DeepSpeed layer (zeroshard.deepspeed), each a torchrun job on gloo ranks.

    torchrun --nproc-per-node 2 tools/bench_facade_step.py step     # stage-2 step: gathers completed in step()
    torchrun --nproc-per-node 2 tools/bench_facade_step.py save16 [LAYERS]   # save_16bit_model's memory

`step`: the native engine leaves its stage 1-2 parameter all-gathers in flight after step() so
that they overlap the next forward; the DeepSpeed layer completes them in step() (scripts read
`engine.module` right after it). Step time of a 4-layer, 128-wide GPT (samples/gpt.py) at stage 2,
with and without `wait_params()` after each step: 12 interleaved pairs of 10-step blocks (order
alternated), the median and IQR of the paired ratios.

`save16`: rank 0's RSS rise while `save_16bit_model` streams a stage-3 bf16 model of LAYERS
(default 24) 2048x2048 linear layers to safetensors, against gathering the whole state dict
first (`_zero3_consolidated_16bit_state_dict`, DeepSpeed's way) and writing it. One run each:
run it for both modes in turn; a thread samples /proc/self/statm every 2 ms.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def step_ab() -> None:
    import zeroshard
    from samples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128))
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8})
    x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(engine.rank))

    def block(wait: bool, n: int = 10) -> float:
        start = time.perf_counter()
        for _ in range(n):
            engine.backward(F.cross_entropy(engine(x).view(-1, 256), x.view(-1)))
            engine.step()
            if wait:
                engine.wait_params()
        torch.distributed.barrier()
        return (time.perf_counter() - start) / n

    block(False, 5)  # warm-up
    ratios = []
    for r in range(12):
        if r % 2 == 0:
            overlap, waited = block(False), block(True)
        else:
            waited, overlap = block(True), block(False)
        ratios.append(waited / overlap)
    if engine.rank == 0:
        q = statistics.quantiles(ratios, n=4)
        print(f"step with gathers completed / overlapped: median {statistics.median(ratios):.3f}x "
              f"(IQR {q[0]:.3f}x-{q[2]:.3f}x), 12 pairs")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def save16(layers: int) -> None:
    import zeroshard.deepspeed as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(layers)])
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg, optimizer=torch.optim.AdamW(model.parameters()))
    with tempfile.TemporaryDirectory() as out:
        for mode in ("stream", "whole dict"):
            before, peak, done = rss(), [0], threading.Event()

            def watch() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss())
                    time.sleep(0.002)

            watcher = threading.Thread(target=watch)
            watcher.start()
            if mode == "stream":
                engine.save_16bit_model(out)
            else:
                state = engine._zero3_consolidated_16bit_state_dict()
                if engine.global_rank == 0:
                    from safetensors.torch import save_file
                    save_file(state, os.path.join(out, "whole.safetensors"))
                del state
            done.set()
            watcher.join()
            if engine.global_rank == 0:
                params = sum(p.numel() for p in model.parameters())
                print(f"{mode}: {params / 1e6:.0f}M params, rank 0 RSS rise {(peak[0] - before) / 2**20:.0f} MiB")


if __name__ == "__main__":
    if sys.argv[1:2] == ["step"]:
        step_ab()
    elif sys.argv[1:2] == ["save16"]:
        save16(int(sys.argv[2]) if len(sys.argv) > 2 else 24)
    else:
        raise SystemExit(__doc__)
