"""One line for a storage failure: what went wrong, without the client's traceback."""

from __future__ import annotations


def describe_error(exc: BaseException) -> str:
    """One line saying what went wrong, for a StorageError."""
    if isinstance(exc, FileNotFoundError):
        return "not found"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, IsADirectoryError):
        return "is a directory"
    text = str(exc).strip() or type(exc).__name__
    if getattr(exc, "errno", None) == 28:
        text = "no space left on device"
    return text.splitlines()[0][:300]
