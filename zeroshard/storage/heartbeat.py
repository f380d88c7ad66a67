"""A background beat: call a function every few seconds until stopped, on a daemon thread.

Used by claims (storage/claim.py) to refresh the time in the claim file while its writer runs, so
that another host can tell a silent claim (its writer's process is gone) from a long write.
"""

from __future__ import annotations

import threading
from typing import Callable


class Heartbeat:
    """Calls `beat()` every `every_s` seconds on a daemon thread, until `stop()` or until `beat`
    returns False. `stop()` waits for a beat in flight, so nothing it writes lands after stop."""

    def __init__(self, beat: Callable[[], bool], every_s: float, name: str = "zeroshard-heartbeat") -> None:
        self._beat = beat
        self._every_s = every_s
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # held while a beat runs: stop() waits for it
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._every_s):
            with self._lock:
                if self._stopped.is_set() or not self._beat():
                    return

    def stop(self) -> None:
        """No beat runs after this returns (idempotent; safe from the beating thread itself)."""
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            with self._lock:
                pass
