"""What the torch the suite runs on can serve as a reference for (tools/dev.sh floor runs the
suite's torch-bound tests on the oldest torch pyproject.toml admits)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.torch_version import torch_release

TORCH = torch_release(torch.__version__)

# FSDP2 over gloo in torch 2.8 sums the gradients where it averages them on NCCL: the moments it saves are
# 2x and 4x DDP's at world 2 (measured against tests/data/dcp) and its losses after a resume differ.
# 2.10 averages (2.9 not tried): before it, FSDP2 on the CPU is not a reference to compare with.
fsdp2_reference = pytest.mark.skipif(TORCH < (2, 10), reason=f"FSDP2 over gloo sums gradients in torch "
                                     f"{torch.__version__} (averaged from 2.10): not a reference")
