"""Who wrote a leftover: `<host id>.<pid>` tags in temp names and claims, and whether that
process is still alive (knowable only on the same host)."""

from __future__ import annotations

import hashlib
import os


def host_id() -> str:
    return hashlib.sha1(os.uname().nodename.encode()).hexdigest()[:8]  # the host name, as gethostname()


def owner_tag() -> str:
    """This process, as `<host id>.<pid>` (computed per call: a forked child has its own pid)."""
    return f"{host_id()}.{os.getpid()}"


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
    """The owner tag inside `<prefix><owner>-<random>-<rest>` ('' for names without one)."""
    tag = name[len(prefix):].split("-", 1)[0]
    return tag if "." in tag else ""
