"""Who wrote a leftover: `<host id>.<pid>` tags in temp names and claims, whether that process
is still alive (knowable only on the same host), and which launched job it belongs to."""

from __future__ import annotations

import functools
import hashlib
import os

# Tests and containers whose hosts share one node name may set this to tell the hosts apart.
HOST_ID_ENV = "ZEROSHARD_HOST_ID"
# torchrun (torchelastic) gives every process of one job, in every incarnation, the same run id
# (the rendezvous id); "none" is torchrun's default for --rdzv-id, shared by unrelated jobs.
_ANONYMOUS_RUN_IDS = {"", "none"}


def host_id() -> str:
    """This host, as 8 hex digits of its node name (or of ZEROSHARD_HOST_ID, when set)."""
    return _hashed(os.environ.get(HOST_ID_ENV) or os.uname().nodename)  # the host name, as gethostname()


@functools.lru_cache(maxsize=8)
def _hashed(name: str) -> str:  # cached: every temp name carries it (packed.py names 1,000s)
    return hashlib.sha1(name.encode()).hexdigest()[:8]


def owner_tag() -> str:
    """This process, as `<host id>.<pid>` (computed per call: a forked child has its own pid)."""
    return f"{host_id()}.{os.getpid()}"


def job_run_id() -> str | None:
    """The launcher's id of the job this process belongs to (TORCHELASTIC_RUN_ID), or None when
    the process was not started by torchrun or its id does not single out one job."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    return None if run_id.lower() in _ANONYMOUS_RUN_IDS else run_id


def job_restart_count() -> int:
    """How many times the launcher restarted this job's workers (0 on the first incarnation)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def owner_alive(tag: str) -> bool | None:
    """True/False for a process of this host; None when unknown (another host, or no tag)."""
    host, _, pid = tag.partition(".")
    if host != host_id() or not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def owner_of_temp(name: str, prefix: str) -> str:
    """The owner tag inside `<prefix><owner>-<random>-<rest>` ('' for names without one).
    See [Note: temp names] (location.py)."""
    tag = name[len(prefix):].split("-", 1)[0]
    return tag if "." in tag else ""
