"""What Accelerate's `save_state` and Hugging Face's Trainer write beside a checkpoint's weights:
LR scheduler states are carried; the rest (RNG states, samplers, training arguments) is named.

[Note: schedulers beside the weights] DeepSpeed holds a scheduler only of its own classes
(WarmupLR, OneCycle, ...). A torch scheduler, such as the LambdaLR every transformers warmup
schedule is, stays with Accelerate, which saves it as `scheduler.bin` (`scheduler_1.bin`, ...
for more), or with the Trainer, which saves `scheduler.pt`: outside DeepSpeed's files, in the
usual set-up. Each is torch.save(scheduler.state_dict()), plain data, so it is read through the
allowlist (torch_pickle.load_pt) and carried as Stateful state, keyed "lr_scheduler",
"lr_scheduler_1", ... in order: the one DeepSpeed held first, then the files by index. A file
that cannot be read as plain data is refused, not left out: the schedule would restart.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.format.training_state import to_json_value
from zeroshard.interop import files
from zeroshard.interop.imported import Imported
from zeroshard.interop.torch_pickle import MAX_NESTING, load_pt, nesting_depth

SCHEDULER_KEY = "lr_scheduler"
SCHEDULER = re.compile(r"^scheduler(?:_(\d+))?\.(?:bin|pt)$")
# Read but not carried: pickles of process state, or weights the checkpoint holds anyway.
NOT_READ = re.compile(r"^(?:random_states_\d+\.pkl|sampler(?:_\d+)?\.bin|dl_state_dict(?:_\d+)?\.bin"
                      r"|custom_checkpoint_\d+\.pkl|scaler\.pt|rng_state(?:_\d+)?\.pth|training_args\.bin"
                      r"|optimizer\.pt)$")
MAX_SCHEDULER_BYTES = 16 * 1024 * 1024  # a scheduler's state is a few numbers per param group


def carry_beside(imp: Imported, folder: str, names: list[str], label: str) -> None:
    """Carry the scheduler files among `names` (in `folder`) into `imp.stateful`; name the others
    in a note starting with `label`."""
    schedulers = sorted((int(m.group(1) or 0), n) for n in names if (m := SCHEDULER.match(n)))
    carried = []
    for _, name in schedulers:
        key = SCHEDULER_KEY if SCHEDULER_KEY not in imp.stateful else f"{SCHEDULER_KEY}_{len(imp.stateful)}"
        imp.stateful[key] = read_scheduler(files.join(folder, name), folder)
        carried.append(f"{key} from {name}")
    if carried:
        imp.notes.append(f"LR scheduler state carried: {', '.join(carried)} (restore it with "
                         f"load_checkpoint(..., lr_scheduler=...) or a Checkpointer's stateful objects)")
    rest = sorted(n for n in names if not SCHEDULER.match(n))
    if rest:
        imp.notes.append(f"{label}, not imported (pickles are not read): {', '.join(rest)}")


def read_scheduler(path: str, folder: str) -> dict[str, Any]:
    """The state dict in scheduler file `path`, as JSON data; CheckpointError naming it otherwise."""
    what = f"the LR scheduler state in {posixpath.basename(path)}"
    hint = "importing without it would restart the schedule: move the file aside to import without it"
    try:
        state = load_pt(path, folder, limit=MAX_SCHEDULER_BYTES)
    except CheckpointError as exc:
        raise CheckpointError(exc.where, f"{exc.problem}; {hint}") from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a scheduler's state dict")
    if nesting_depth(state) > MAX_NESTING:
        raise CheckpointError(path, f"nests containers more than {MAX_NESTING} deep")
    try:
        return to_json_value(state, what)
    except TypeError as exc:
        raise CheckpointError(path, f"{exc}; {hint}") from None
