"""Write tests/data/deepspeed_releases/deepspeed-X.Y.Z: real checkpoints from an older DeepSpeed.

Users migrate with checkpoints their own DeepSpeed wrote, rarely the newest one. Run this with the
Python of a venv holding that DeepSpeed (and a torch of its time), built for instance as:

    python3 -m venv /tmp/ds0145 && /tmp/ds0145/bin/pip install torch==2.4.1 "numpy<2" wheel "setuptools<70" safetensors
    DS_BUILD_OPS=0 /tmp/ds0145/bin/pip install --no-build-isolation deepspeed==0.14.5
    /tmp/ds0145/bin/python tools/make_deepspeed_release_fixtures.py [VARIANT ...]

For each variant, tools/make_deepspeed_fixtures.py's run (train, save, train on; a fresh engine's
resume: expected.json), then DeepSpeed's own `zero_to_fp32` of that release on the saved
checkpoint, written as expected.safetensors (fp32 weights, every name, tied ones included): what an
import of it must hold, bit for bit (none where zero_to_fp32 refuses the layout: BF16_Optimizer's).
`LOCAL_SIZE` is set as DeepSpeed's launcher sets it: without it, DeepSpeed 0.14's CPU accelerator
runs `numactl` to count devices.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["stage1", "stage2", "stage3", "bf16_stage2", "bf16_stage3", "frozen_stage3", "stage3_subgroups",
           "config_file"]


def fp32_reference(folder: Path) -> None:
    """DeepSpeed's own consolidation of `folder` (its latest tag) into folder/expected.safetensors."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    try:
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    except ValueError as exc:  # e.g. BF16_Optimizer's files (bf16 at stage 1): "is not a zero checkpoint"
        print(f"{folder.name}: no expected.safetensors: DeepSpeed's zero_to_fp32 refuses it: {exc}", file=sys.stderr)
        return
    weights = {name: t.detach().clone().contiguous() for name, t in state.items()}  # tied ones: a copy each
    save_file(weights, str(folder / "expected.safetensors"))


def record_clipping(folder: Path) -> None:
    """The fixtures' config leaves gradient_clipping to DeepSpeed's default, which changed (0.0 up to
    0.16, 1.0 by 0.19): expected.json records the one this release trained with."""
    import json

    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    path = folder / "expected.json"
    expected = json.loads(path.read_text())
    expected["gradient_clipping"] = float(GRADIENT_CLIPPING_DEFAULT)
    path.write_text(json.dumps(expected, indent=1) + "\n")


def main() -> None:
    import deepspeed

    out = ROOT / "tests" / "data" / "deepspeed_releases" / f"deepspeed-{deepspeed.__version__}"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1"}
    for variant in sys.argv[1:] or DEFAULT:
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_deepspeed_fixtures.py"), str(out), variant],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        fp32_reference(out / variant)
        record_clipping(out / variant)
        print(out / variant)


if __name__ == "__main__":
    main()
