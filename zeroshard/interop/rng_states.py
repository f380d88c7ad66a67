"""The RNG streams Hugging Face's Trainer (`rng_state_{r}.pth`) and Accelerate
(`random_states_{r}.pkl`) save per process, as the engine's RNGState state (docs/FORMAT.md §9.3:
torch's CPU generator, Python's `random`, NumPy's global generator), so that a resume at the same
world size draws the same dropout masks as the source's own resume would.

[Note: NumPy in the allowlist] Both files hold NumPy's generator state, an ndarray. They are read
with the allowlist plus the globals that rebuild a plain uint32 ndarray (NumPy's `_reconstruct`,
`ndarray`, `dtype` and the uint32 dtype's class), for these files only, and every field is
checked before it is used. RNG streams are not model data: a file that cannot be read or checked
is named in a note and the streams stay the engine's own; a callable in one never runs either way.
"""

from __future__ import annotations

import re
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.interop.torch_pickle import load_pt

TRAINER_RNG = re.compile(r"^rng_state(?:_(\d+))?\.pth$")  # rng_state.pth: a single process
ACCELERATE_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
MAX_RNG_BYTES = 1 << 20  # a few generator states: ~15 KB
MT_WORDS = 624  # Mersenne Twister state words (Python keeps one more: the position)


def rng_files(names: list[str]) -> dict[int, str]:
    """The RNG files among `names`, by process index (one naming scheme: the Trainer's first)."""
    for pattern in (TRAINER_RNG, ACCELERATE_RNG):
        found = {int(m.group(1) or 0): n for n in names if (m := pattern.match(n))}
        if found:
            return found
    return {}


def read_rng_state(path: str, folder: str) -> dict[str, Any]:
    """RNGState's state from one Trainer or Accelerate RNG file; CheckpointError naming it if the
    file cannot be read or a field is not what the generator needs."""
    import numpy as np
    import torch

    reconstruct = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    # NumPy 2 pickles the dtype's class too
    numpy_globals = (np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct._reconstruct)
    try:
        saved = load_pt(path, folder, MAX_RNG_BYTES, allow=numpy_globals)
    except CheckpointError as exc:  # refused (a global outside the allowlist) or unreadable: one line
        raise CheckpointError(path, f"not read: {exc.problem}") from None
    if not isinstance(saved, dict):
        raise CheckpointError(path, f"holds a {type(saved).__name__}, not a dict of RNG states")
    trainer = "cpu" in saved
    cpu, python, numpy_state = (saved.get(k) for k in (("cpu", "python", "numpy") if trainer else
                                                       ("torch_manual_seed", "random_state", "numpy_random_seed")))
    if not (torch.is_tensor(cpu) and cpu.dtype == torch.uint8 and cpu.dim() == 1):
        raise CheckpointError(path, "holds no torch CPU generator state (a 1-D uint8 tensor)")
    state: dict[str, Any] = {"torch": cpu.clone(), "python": _python(path, python), "numpy": _numpy(path, numpy_state)}
    cuda = saved.get("cuda")
    if torch.is_tensor(cuda) and cuda.dtype == torch.uint8 and cuda.dim() == 1:  # the Trainer's, one device
        state["cuda"] = cuda.clone()
    return state


def _python(path: str, value: Any) -> dict[str, Any]:
    import torch

    ok = isinstance(value, (tuple, list)) and len(value) == 3 and isinstance(value[0], int) \
        and isinstance(value[1], (tuple, list)) and len(value[1]) == MT_WORDS + 1 \
        and all(isinstance(v, int) and 0 <= v < 2**32 for v in value[1]) \
        and (value[2] is None or isinstance(value[2], float))
    if not ok:
        raise CheckpointError(path, "its Python `random` state is not random.getstate()'s")
    return {"version": value[0], "state": torch.tensor(value[1], dtype=torch.int64), "gauss": value[2]}


def _numpy(path: str, value: Any) -> dict[str, Any]:
    import numpy as np
    import torch

    ok = isinstance(value, (tuple, list)) and len(value) == 5 and value[0] == "MT19937" \
        and isinstance(value[1], np.ndarray) and value[1].dtype == np.uint32 and value[1].shape == (MT_WORDS,) \
        and isinstance(value[2], int) and 0 <= value[2] <= MT_WORDS and value[3] in (0, 1) \
        and isinstance(value[4], float)
    if not ok:
        raise CheckpointError(path, "its NumPy state is not numpy.random.get_state()'s")
    return {"kind": "MT19937", "keys": torch.from_numpy(value[1].astype(np.int64)), "pos": value[2],
            "has_gauss": int(value[3]), "cached_gaussian": value[4]}
