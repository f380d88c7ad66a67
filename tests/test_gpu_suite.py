"""`tools/dev.sh gpu` on a machine without CUDA: it prints its plan, runs nothing, exits 0; and
its report is made from what the benchmark really writes (a tiny CPU run of the same tool)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TIER = "mixed"  # docs/TESTING.md

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_suite  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine `tools/dev.sh gpu` really runs")
@pytest.mark.timeout(120)
def test_dev_sh_gpu_prints_its_plan_and_runs_nothing_without_cuda(tmp_path: Path) -> None:
    out = tmp_path / "results"
    for extra in ([], ["--dry-run"]):
        proc = subprocess.run(["bash", str(ROOT / "tools" / "dev.sh"), "gpu", "--out", str(out), *extra],
                              capture_output=True, text=True, timeout=100,
                              env={**os.environ, "ZEROSHARD_GPU_PYTHON": sys.executable})
        assert proc.returncode == 0, proc.stderr
        names = [s.name for s in gpu_suite.plan(sys.executable, 1, gpu_suite.parse_args([]))]
        for i, name in enumerate(names, 1):
            assert f"  {i}. {name}:" in proc.stdout
        assert ("dry run" if extra else "no CUDA device visible") in proc.stdout
        assert "--device cuda" in proc.stdout and "tests/test_engine_gpu.py" in proc.stdout
        assert "--install-check" in proc.stdout and "--readme-check" in proc.stdout
        assert not out.exists()  # nothing ran, nothing written


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_report_is_made_from_a_real_benchmark_run(tmp_path: Path) -> None:
    """The same bench_train.py the GPU run uses, on 2 CPU ranks, feeds the report's tables."""
    result = tmp_path / "step-time.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_train.py"), "--device", "cpu",
                           "--methods", "ddp,zs1", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                           "--block-size", "8", "--batch", "2", "--steps", "2", "--warmup", "2",
                           "--rounds", "1", "--json", str(result)], capture_output=True, text=True, timeout=550,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    bench = json.loads(result.read_text())
    memory = gpu_suite.memory_rows(bench)
    assert [m["stage"] for m in memory] == [1]
    zs1 = next(r for r in bench["results"] if r["method"] == "zs1")
    assert memory[0]["memory_report_bytes"] == zs1["peak_memory"][0]["total"] > 0
    assert memory[0]["cuda_max_allocated"] is None  # a CPU run has no CUDA peak

    step = gpu_suite.Step("step-time-fp32", "tiny", [], outcome={
        "exit": 0, "seconds": 1.0, "figures": {"results": bench["results"], "memory": memory}})
    table = gpu_suite.markdown([step], "test")
    assert "| ddp |" in table and "| 1.00 |" in table  # DDP against itself
    ratio = zs1["step_ms"] / next(r for r in bench["results"] if r["method"] == "ddp")["step_ms"]
    assert f"| zs1 | {zs1['step_ms']:.1f} | {ratio:.2f} |" in table
