"""Let gloo's worker threads drop their finished work before the interpreter finalizes.

torch 2.13's ProcessGroupGloo destroys a finished collective's work object on its worker
thread. When that work held the last reference to a tensor whose Python object was already
released (a temporary passed to a collective: `all_gather_object`'s buffers, `t.data`), the
destructor must take the GIL to free that Python object. If the main thread is already
finalizing the interpreter, taking the GIL ends the thread with `pthread_exit`, whose forced
unwind through a noexcept frame calls std::terminate: "terminate called without an active
exception", SIGABRT, at exit of a script that did everything right. Plain torch does it too
(7 of 20 launches of init_process_group + all_gather_object + exit, on a loaded 2-core
machine); the gdb backtrace is in docs/ENGINE.md, "Exit".

atexit callbacks run before finalization starts, while threads can still take the GIL: one
short sleep there lets the workers finish their destructors. Registered by the first
collective zeroshard issues; costs EXIT_GRACE_S once per process.
"""

from __future__ import annotations

import atexit
import time

EXIT_GRACE_S = 0.1
_registered = False


def drain_gloo_workers_at_exit() -> None:
    """Register (once) the exit-time grace period for gloo's worker threads."""
    global _registered
    if not _registered:
        atexit.register(time.sleep, EXIT_GRACE_S)
        _registered = True
