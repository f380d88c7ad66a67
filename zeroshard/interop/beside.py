"""What Accelerate's `save_state` and Hugging Face's Trainer write beside a checkpoint's weights:
LR scheduler states, Accelerate's custom objects, the Trainer's trainer_state.json and both
tools' per-process RNG streams (rng_states.py) are carried; the rest (samplers, training
arguments) is named.

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

import json
import posixpath
import re
from typing import Any

from zeroshard.errors import CheckpointError
from zeroshard.format.training_state import to_json_value
from zeroshard.interop import files
from zeroshard.interop.imported import Imported, holds_tensors
from zeroshard.interop.rng_states import ACCELERATE_RNG, TRAINER_RNG, read_rng_state, rng_files
from zeroshard.interop.torch_pickle import MAX_NESTING, load_pt, nesting_depth

SCHEDULER_KEY = "lr_scheduler"
SCHEDULER = re.compile(r"^scheduler(?:_(\d+))?\.(?:bin|pt)$")
CUSTOM = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
# Read but not carried: pickles of process state, or weights the checkpoint holds anyway.
NOT_READ = re.compile(r"^(?:sampler(?:_\d+)?\.bin|dl_state_dict(?:_\d+)?\.bin|scaler\.pt|training_args\.bin"
                      r"|optimizer\.pt)$")
MAX_STATE_BYTES = 16 * 1024 * 1024  # a scheduler's state is a few numbers per param group
TRAINER_STATE = "trainer_state.json"  # what transformers' Trainer writes in checkpoint-N
TRAINER_STATE_KEY = "hf_trainer_state"  # where it lands in the imported client_state
MAX_TRAINER_STATE_BYTES = 64 * 1024 * 1024  # log_history of a long run; far above any real one


def is_beside(name: str) -> bool:
    """Whether `name` is a file Accelerate or the Trainer writes beside a checkpoint's weights."""
    return bool(SCHEDULER.match(name) or CUSTOM.match(name) or NOT_READ.match(name) or name == TRAINER_STATE
                or TRAINER_RNG.match(name) or ACCELERATE_RNG.match(name))


def carry_beside(imp: Imported, folder: str, names: list[str], label: str) -> None:
    """Carry the scheduler and custom-object files among `names` (in `folder`) into
    `imp.stateful` and trainer_state.json into the client state; name the others in a note
    starting with `label`."""
    if TRAINER_STATE in names:
        carry_trainer_state(imp, folder)
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
    rng = rng_files(names)
    if rng:
        carry_rng(imp, folder, rng)
    rest = sorted(n for n in names if not SCHEDULER.match(n) and not CUSTOM.match(n) and n != TRAINER_STATE
                  and n not in rng.values())
    if rest:
        imp.notes.append(f"{label}, not imported (pickles are not read): {', '.join(rest)}")


def carry_rng(imp: Imported, folder: str, rng: dict[int, str]) -> None:
    """Each process's RNG streams into its rank's state, when there is one file per rank; else,
    or if one cannot be read, a note says why the engine's own streams stay."""
    shown = f"{rng[min(rng)]}{', ...' if len(rng) > 1 else ''}"
    if sorted(rng) != list(range(imp.world_size)):
        imp.notes.append(f"RNG streams not carried: {shown} cover processes {', '.join(map(str, sorted(rng)))} of a "
                         f"{imp.world_size}-rank save")
        return
    try:
        states = {rank: {"rng": read_rng_state(files.join(folder, name), folder)} for rank, name in rng.items()}
    except CheckpointError as exc:
        imp.notes.append(f"RNG streams not carried: {exc}")
        return
    imp.rank_states = states
    imp.notes.append(f"RNG streams of the {len(states)} ranks read ({shown}), written when the import keeps "
                     f"{len(states)} ranks: engine.load_checkpoint restores them")


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


def carry_trainer_state(imp: Imported, folder: str) -> None:
    """Hugging Face Trainer's checkpoint-N/trainer_state.json into client_state[TRAINER_STATE_KEY]:
    bounded in size and nesting, plain JSON, never executed."""
    path = files.join(folder, TRAINER_STATE)
    raw = files.read_inside(path, folder, MAX_TRAINER_STATE_BYTES)
    try:
        state = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(path, f"is not a JSON document ({type(exc).__name__}: {str(exc)[:80]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"must hold a JSON object, got {type(state).__name__}")
    if nesting_depth(state) > MAX_NESTING:
        raise CheckpointError(path, f"nested deeper than {MAX_NESTING} levels")
    if not isinstance(imp.client_state, dict):
        imp.client_state = {}
    if TRAINER_STATE_KEY in imp.client_state:
        raise CheckpointError(path, f"the client state already has a {TRAINER_STATE_KEY!r} key")
    imp.client_state[TRAINER_STATE_KEY] = state
