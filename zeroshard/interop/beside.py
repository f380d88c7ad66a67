"""What Accelerate's `save_state` and Hugging Face's Trainer write beside a checkpoint's weights:
LR scheduler states and Accelerate's custom objects are carried; the rest (RNG states, samplers,
training arguments) is named.

[Note: schedulers beside the weights] DeepSpeed holds a scheduler only of its own classes
(WarmupLR, OneCycle, ...). A torch scheduler, such as the LambdaLR every transformers warmup
schedule is, stays with Accelerate, which saves it as `scheduler.bin` (`scheduler_1.bin`, ...
for more), or with the Trainer, which saves `scheduler.pt`: outside DeepSpeed's files, in the
usual set-up. Each is torch.save(scheduler.state_dict()), plain data, so it is read through the
allowlist (torch_pickle.load_pt) and carried as Stateful state, keyed "lr_scheduler",
"lr_scheduler_1", ... in order: the one DeepSpeed held first, then the files by index. A file
that cannot be read as plain data is refused, not left out: the schedule would restart.

Objects registered with Accelerate's `register_for_checkpointing` are saved the same way, as
`custom_checkpoint_N.pkl`: carried under the key "custom_checkpoint_N" when plain data (a step
counter, a data position); one holding tensors (an EMA copy of the model, the usual reason to
register one) is refused: a global Stateful state is JSON, and leaving it out loses model data.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.format.training_state import to_json_value
from zeroshard.interop import files
from zeroshard.interop.imported import Imported, holds_tensors
from zeroshard.interop.torch_pickle import MAX_NESTING, load_pt, nesting_depth

SCHEDULER_KEY = "lr_scheduler"
SCHEDULER = re.compile(r"^scheduler(?:_(\d+))?\.(?:bin|pt)$")
CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
# Read but not carried: pickles of process state, or weights the checkpoint holds anyway.
NOT_READ = re.compile(r"^(?:random_states_\d+\.pkl|sampler(?:_\d+)?\.bin|dl_state_dict(?:_\d+)?\.bin"
                      r"|scaler\.pt|rng_state(?:_\d+)?\.pth|training_args\.bin"
                      r"|optimizer\.pt)$")
MAX_STATE_BYTES = 16 * 1024 * 1024  # a scheduler's state is a few numbers per param group


def is_beside(name: str) -> bool:
    """Whether `name` is a file Accelerate or the Trainer writes beside a checkpoint's weights."""
    return bool(SCHEDULER.match(name) or CUSTOM.match(name) or NOT_READ.match(name))


def carry_beside(imp: Imported, folder: str, names: list[str], label: str) -> None:
    """Carry the scheduler and custom-object files among `names` (in `folder`) into
    `imp.stateful`; name the others in a note starting with `label`."""
    schedulers = sorted((int(m.group(1) or 0), n) for n in names if (m := SCHEDULER.match(n)))
    carried = []
    for _, name in schedulers:
        held = sum(1 for k in imp.stateful if k == SCHEDULER_KEY or k.startswith(f"{SCHEDULER_KEY}_"))
        key = f"{SCHEDULER_KEY}_{held}" if held else SCHEDULER_KEY
        imp.stateful[key] = read_state(files.join(folder, name), folder, "the LR scheduler state",
                                       "restart the schedule")
        carried.append(f"{key} from {name}")
    if carried:
        imp.notes.append(f"LR scheduler state carried: {', '.join(carried)} (restore it with "
                         f"load_checkpoint(..., lr_scheduler=...) or a Checkpointer's stateful objects)")
    customs = sorted((int(m.group(1)), n) for n in names if (m := CUSTOM.match(n)))
    for _, name in customs:
        key = name.rsplit(".", 1)[0]
        imp.stateful[key] = read_state(files.join(folder, name), folder, "the registered object's state", "lose it")
    if customs:
        imp.notes.append(f"Accelerate's registered objects carried as Stateful state: "
                         f"{', '.join(n.rsplit('.', 1)[0] for _, n in customs)} (restore each with a Checkpointer's "
                         f"stateful objects under that key)")
    rest = sorted(n for n in names if not SCHEDULER.match(n) and not CUSTOM.match(n))
    if rest:
        imp.notes.append(f"{label}, not imported (pickles are not read): {', '.join(rest)}")


def read_state(path: str, folder: str, what: str, loss: str) -> dict[str, Any]:
    """The state dict in the torch file `path`, as JSON data; CheckpointError naming it otherwise
    (`loss`: what importing without it would do)."""
    hint = f"importing without it would {loss}: move the file aside to import without it"
    try:
        state = load_pt(path, folder, limit=MAX_STATE_BYTES)
    except CheckpointError as exc:
        raise CheckpointError(exc.where, f"{exc.problem}; {hint}") from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a state dict; {hint}")
    if nesting_depth(state) > MAX_NESTING:
        raise CheckpointError(path, f"nests containers more than {MAX_NESTING} deep")
    if holds_tensors(state):  # model data (an EMA copy): never dropped
        raise CheckpointError(path, f"{what} holds tensors, which a zeroshard checkpoint carries only as the model's "
                                    f"and optimizer's; {hint}")
    try:
        return to_json_value(state, f"{what} in {posixpath.basename(path)}")
    except TypeError as exc:
        raise CheckpointError(path, f"{exc}; {hint}") from None
