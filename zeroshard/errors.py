"""Errors users see. Each names the file (or URL) concerned and what is wrong with it, in one line.

The whole hierarchy, every class exported from `zeroshard`:

    ZeroshardError                  everything zeroshard raises on purpose
    +-- CheckpointError             a checkpoint or model source is missing, corrupt or inconsistent
    +-- StorageError                reading or writing a path failed
    |   +-- ClaimError              another writer holds the output (zeroshard/storage/claim.py)
    +-- OutputExistsError           the output exists and --overwrite was not given
    +-- CheckpointSaveError         a save failed on some rank: nothing committed
    +-- OtherRanksFailedError       raised on the ranks that did not fail, naming those that did
    +-- PeerLostError               a collective lost contact with other ranks (a node died), naming them
    +-- ConfigError (also ValueError)  an invalid engine config
    +-- InvalidArgumentError (also ValueError)  a value passed to a public function is invalid
    +-- ArgumentTypeError (also TypeError)  a value passed to a public function has the wrong type
    +-- MissingKeyError (also KeyError)  names asked for or given that are not there (state dicts, ranks)
    +-- EngineUsageError (also RuntimeError)  the engine used out of order or against its rules
        +-- RanksBuiltDifferentModelsError  initialize() found ranks that built different models
    +-- UnsupportedFeatureError (also NotImplementedError)  a DeepSpeed feature zeroshard.deepspeed refuses
"""

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


class ClaimError(StorageError):
    """Another writer holds the output (zeroshard/storage/claim.py)."""


class OutputExistsError(ZeroshardError):
    """The output already exists and overwriting was not asked for."""

    def __init__(self, where: str):
        self.where = where
        super().__init__(f"{where}: already exists (pass --overwrite to replace it)")

    def __reduce__(self):
        return type(self), (self.where,)


class CheckpointSaveError(ZeroshardError):
    """A save failed on at least one rank; nothing was committed and `latest` did not move."""


class OtherRanksFailedError(ZeroshardError):
    """A collective operation failed on other ranks (each raised its own error); this rank did nothing more."""

    SHOWN = 3  # at thousands of ranks, the first few messages say enough

    def __init__(self, action: str, failed: dict[int, str]):
        self.action = action
        self.failed = dict(failed)
        ranks = sorted(self.failed)
        listed = ", ".join(map(str, ranks[:20])) + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")
        details = "; ".join(f"rank {r}: {self.failed[r]}" for r in ranks[: self.SHOWN])
        super().__init__(f"{action} failed on rank(s) {listed}: {details}")

    def __reduce__(self):
        return type(self), (self.action, self.failed)


class PeerLostError(ZeroshardError):
    """A collective failed because other ranks went away (a killed node, a closed connection, a
    timeout); names the lost ranks and their hosts where known (zeroshard/peers.py). The
    library's error is the __cause__."""

    def __init__(self, action: str, lost: dict[int, str], detail: str):
        self.action = action
        self.lost = dict(lost)  # rank -> host name ('' where unknown)
        self.detail = detail
        if self.lost:
            ranks = sorted(self.lost)
            hosts = sorted({h for h in self.lost.values() if h})
            who = f"rank(s) {', '.join(map(str, ranks))}" + (f" on host(s) {', '.join(hosts)}" if hosts else "")
        else:
            who = "other ranks (which ones could not be learned)"
        super().__init__(f"{action}: lost contact with {who}; the job must be restarted: {detail}")

    def __reduce__(self):
        return type(self), (self.action, self.lost, self.detail)


class ConfigError(ZeroshardError, ValueError):
    """An invalid engine config (unknown key, bad value or type); names the key."""


class InvalidArgumentError(ZeroshardError, ValueError):
    """A value passed to a public function is invalid (the message names it); still a ValueError for callers
    that catch that."""


class ArgumentTypeError(ZeroshardError, TypeError):
    """A value passed to a public function has the wrong type (the message names it and the type expected)."""


class MissingKeyError(ZeroshardError, KeyError):
    """Names that were asked for or given are not there (parameters of a state dict, a rank of a manifest)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class EngineUsageError(ZeroshardError, RuntimeError):
    """The engine was used out of order or against its rules (the message says which and how to fix it)."""


class RanksBuiltDifferentModelsError(EngineUsageError):
    """Raised on every rank by initialize() when ranks built different models (names, shapes, dtypes,
    zero_init() or eager), before any collective whose sizes depend on the model."""


class UnsupportedFeatureError(ZeroshardError, NotImplementedError):
    """A DeepSpeed feature zeroshard.deepspeed does not provide (the message names it and says why)."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` of an exception, cut to its first line and `limit` characters: a user's
    load_state_dict may raise anything, and the error that reports it must stay one line."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if len(first) > limit:
        first = first[:limit - 3] + "..."
    more = " ..." if first and len(text.splitlines()) > 1 else ""
    return f"{type(exc).__name__}: {first}{more}" if first else type(exc).__name__
