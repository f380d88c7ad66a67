"""Errors users see. Each names the file (or URL) concerned and what is wrong with it, in one line."""

from __future__ import annotations


class ZeroshardError(Exception):
    """Base of every error zeroshard raises on purpose; the CLI prints these without a traceback."""


class _Located(ZeroshardError):
    """An error about one file or URL: `where`, then what is wrong with it."""

    def __init__(self, where: str, problem: str):
        self.where = where
        self.problem = problem
        super().__init__(f"{where}: {problem}")

    def __reduce__(self):  # crosses process boundaries intact (parallel workers)
        return type(self), (self.where, self.problem)


class CheckpointError(_Located):
    """A checkpoint (or a full-model source) is missing, incomplete, corrupt or inconsistent."""


class StorageError(_Located):
    """Reading or writing a path failed (missing object, permission, network, disk full)."""


class OutputExistsError(ZeroshardError):
    """The output already exists and overwriting was not asked for."""

    def __init__(self, where: str):
        self.where = where
        super().__init__(f"{where}: already exists (pass --overwrite to replace it)")

    def __reduce__(self):
        return type(self), (self.where,)
