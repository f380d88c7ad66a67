"""One writer per output: a claim file created atomically before anything is written.

Locally the claim is created with O_CREAT|O_EXCL; on S3 with a conditional PUT
(If-None-Match: *), which S3 (since 2024) and moto honour: of two writers, exactly one creates
it and the other is refused before it writes a byte. The claim names its owner (host id and
pid) so that a claim left by a killed process on this host is taken over on the next run. Another host's processes
cannot be seen, so while its writer runs a heartbeat thread rewrites the claim's `beat` time
every HEARTBEAT_S: a claim silent for SILENT_CLAIM_S is taken over (its writer's process is
gone; on this host, its pid was reused), one still beating never is, however long the write. A
claim without a beat (written by an earlier zeroshard) is taken over only once older than
STALE_CLAIM_S (`zeroshard clean --older-than` removes either sooner), and before it commits a
writer checks that its claim is still its own. A job-scoped claim (a checkpoint save's, taken by
rank 0) also records the launcher's run id: a claim of the same run made by another process was
left by an earlier incarnation of this job (its launcher re-formed the world without it, on any
host), so it is taken over at once, with one log line naming the old owner (docs/SAFETY.md,
section 3).

A claim *marked torn* (`Claim.mark_torn`) is one whose writer has finished without committing and
without knowing that every file of its output was removed (a checkpoint save that lost a peer): it
blocks no writer, and it marks the files beside it as an interrupted writer's, for `zeroshard
clean`, pruning and the next save of that tag to remove.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

from zeroshard.errors import ClaimError, StorageError
from zeroshard.storage.heartbeat import Heartbeat
from zeroshard.storage.location import Location
from zeroshard.storage.owner import job_restart_count, job_run_id, owner_alive, owner_tag

CLAIM_NAME = ".zeroshard-claim"
# A claim of another host without a heartbeat (an earlier zeroshard's) is presumed dead after this
# long: no save or toolkit run held an output for 6 hours, and a crashed job must not block a tag forever.
STALE_CLAIM_S = 6 * 3600.0
# A live writer refreshes its claim every HEARTBEAT_S; twenty missed beats prove it gone, with room
# for a stalled store, a paused VM and clocks of different hosts a few minutes apart.
HEARTBEAT_S = 30.0
SILENT_CLAIM_S = 600.0
log = logging.getLogger(__name__)


@dataclass
class Claim:
    location: Location
    nonce: str
    # taken over from an earlier writer (dead, torn or superseded): output files it left in the
    # folder without a commit file are that writer's (leftovers.remove_leftovers_of_others)
    took_over: bool = False
    what: str = "output"
    heartbeat: Heartbeat | None = field(default=None, repr=False)

    def start_heartbeat(self) -> None:
        self.heartbeat = Heartbeat(self._beat, HEARTBEAT_S, name=f"zeroshard-claim-{self.nonce[:8]}")

    def _beat(self) -> bool:
        """Refresh `beat` in the claim while it is still ours; False (stop beating) once it is not."""
        try:
            doc = _read_claim_strictly(self.location)
            if doc is not None and doc.get("nonce") == self.nonce:
                self.location.write_bytes(CLAIM_NAME, json.dumps({**doc, "beat": time.time()}).encode())
                return True
        except Exception:  # a store that did not answer this time: beat again later
            return True
        log.warning("%s: the claim of this %s was taken over or removed while this process held it; "
                    "it will not commit", self.location.url_of(CLAIM_NAME), self.what)
        return False

    def check_held(self) -> None:
        """Raise ClaimError unless the claim is still this writer's: called just before a commit,
        so that a writer judged gone (silent past SILENT_CLAIM_S: a paused process) never commits
        over the writer that took its place."""
        doc = _read_claim_strictly(self.location)
        if doc is None or doc.get("nonce") != self.nonce:
            holder = "removed" if doc is None else f"taken over by owner {doc.get('owner', '?')}"
            raise ClaimError(self.location.url_of(CLAIM_NAME),
                             f"this {self.what}'s claim was {holder} while this process wrote it "
                             f"(judged gone: paused, or cut off from the store?); nothing committed")

    def release(self) -> None:
        """Remove the claim if it is still ours (best effort: a failure here loses nothing)."""
        self._stop_heartbeat()
        with contextlib.suppress(Exception):
            if read_claim(self.location).get("nonce") == self.nonce:
                self.location.remove(CLAIM_NAME)

    def mark_torn(self) -> None:
        """Instead of release(): this writer has stopped without committing, and files it (or its
        peers) wrote may remain. The claim stays, rewritten atomically as torn, so it no longer
        blocks a writer and marks those files as an interrupted writer's (best effort, as release)."""
        self._stop_heartbeat()
        with contextlib.suppress(Exception):
            doc = read_claim(self.location)
            if doc.get("nonce") == self.nonce:
                self.location.write_bytes(CLAIM_NAME, json.dumps({**doc, "torn": time.time()}).encode())

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()


def is_torn(doc: dict) -> bool:
    """Whether a claim's content (read_claim) says its writer stopped without committing."""
    return isinstance(doc.get("torn"), (int, float)) and not isinstance(doc.get("torn"), bool)


def silent_for(doc: dict, now: float | None = None) -> float | None:
    """Seconds since the claim's last heartbeat; None for a claim written without one."""
    beat = doc.get("beat")
    if not isinstance(beat, (int, float)) or isinstance(beat, bool):
        return None
    return (time.time() if now is None else now) - beat


def writer_alive(doc: dict) -> bool | None:
    """Whether the writer a claim's content names is still writing: False once marked torn or
    silent past SILENT_CLAIM_S (a live writer beats: a live pid that does not is a reused one),
    else its owner process's state (owner.owner_alive: None when it is of another host)."""
    if is_torn(doc) or (silent_for(doc) or 0.0) > SILENT_CLAIM_S:
        return False
    return owner_alive(str(doc.get("owner", "")))


def read_claim(location: Location) -> dict:
    """The claim's content ({} when absent or unreadable)."""
    try:
        return _read_claim_strictly(location) or {}
    except Exception:
        return {}


def _read_claim_strictly(location: Location) -> dict | None:
    """The claim's content ({} when it is not a JSON object); None when there is no claim file;
    a store that fails to answer raises (unlike read_claim, absence is told from a failed read)."""
    try:
        raw = location.read_bytes(CLAIM_NAME, 0, 4096)
    except StorageError as exc:
        if isinstance(exc.__cause__, FileNotFoundError):
            return None
        raise
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def take_claim(location: Location, what: str = "output", *, job_scoped: bool = False) -> Claim:
    """Claim `location` for this process, or raise ClaimError naming the holder.

    job_scoped: this process is the only one of its job (its launcher's run id) that takes such
    claims, as rank 0 is for checkpoint saves; the claim records the run id, and a job-scoped
    claim of the same run id made by another process is taken over as superseded."""
    nonce = uuid.uuid4().hex
    now = time.time()
    doc = {"owner": owner_tag(), "pid": os.getpid(), "time": now, "beat": now, "nonce": nonce}
    run_id = job_run_id() if job_scoped else None
    if run_id is not None:
        doc.update(job=run_id, restart=job_restart_count())
    body = json.dumps(doc).encode()
    took_over = False
    for _ in range(3):
        if location.create_exclusive(CLAIM_NAME, body):
            return _held(location, nonce, took_over, what)
        holder = read_claim(location)
        if holder.get("nonce") == nonce:  # our PUT landed, its answer was lost, and the retry was refused
            return _held(location, nonce, took_over, what)
        if not holder and location.exists(CLAIM_NAME) and not location.is_link(CLAIM_NAME):
            time.sleep(0.05)  # being written by its creator (only where no hard links): look again
            holder = read_claim(location)
        age = time.time() - holder["time"] if isinstance(holder.get("time"), (int, float)) else 0.0
        alive = owner_alive(str(holder.get("owner", "")))
        silent = silent_for(holder)
        link = location.is_link(CLAIM_NAME)
        if alive is False or (alive is None and silent is None and age > STALE_CLAIM_S) or link:
            _take_over(location, holder.get("nonce"))
            took_over = took_over or not link  # a link is nobody's claim: it vouches for no files
            continue
        if silent is not None and silent > SILENT_CLAIM_S:  # of another host, or a pid reused since
            log.warning("%s: taking over the claim of %s (owner %s): no heartbeat for %.0f s, its writer "
                        "is gone", location.url_of(CLAIM_NAME), what, holder.get("owner", "?"), silent)
            _take_over(location, holder.get("nonce"))
            took_over = True
            continue
        if is_torn(holder):
            log.warning("%s: taking over the claim of %s left by a writer that stopped without committing "
                        "(owner %s)", location.url_of(CLAIM_NAME), what, holder.get("owner", "?"))
            _take_over(location, holder.get("nonce"))
            took_over = True
            continue
        if run_id is not None and _superseded(holder, run_id):
            log.warning("%s: taking over the claim of %s (owner %s, restart %s of this job %s): "
                        "that incarnation is gone", location.url_of(CLAIM_NAME), what,
                        holder.get("owner", "?"), holder.get("restart", "?"), run_id)
            _take_over(location, holder.get("nonce"))
            took_over = True
            continue
        since = (time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(holder["time"]))
                 if isinstance(holder.get("time"), (int, float)) else "?")
        beat = "" if silent is None else f", last heartbeat {max(silent, 0.0):.0f} s ago"
        raise ClaimError(location.url_of(CLAIM_NAME),
                         f"this {what} is being written by another zeroshard process "
                         f"(owner {holder.get('owner', '?')}, since {since} UTC{beat}); wait for it, "
                         f"or if it is gone, remove this file (zeroshard clean)")
    raise ClaimError(location.url_of(CLAIM_NAME), f"could not claim this {what}: other writers keep taking it")


def _held(location: Location, nonce: str, took_over: bool, what: str) -> Claim:
    claim = Claim(location, nonce, took_over, what)
    claim.start_heartbeat()
    return claim


def _superseded(holder: dict, run_id: str) -> bool:
    """A job-scoped claim of this run made by another process: an earlier incarnation's rank 0.
    Within one incarnation only this process takes job-scoped claims, and the launcher starts an
    incarnation only after stopping the previous one, so that owner cannot still be writing."""
    return holder.get("job") == run_id and holder.get("owner") != owner_tag()


def _take_over(location: Location, stale_nonce: object) -> None:
    """Remove a dead owner's claim, and only that one: locally the claim is first renamed aside,
    so a live claim that replaced it meanwhile is put back untouched."""
    if not location.local:
        if read_claim(location).get("nonce") == stale_nonce:
            location.remove(CLAIM_NAME)
        return
    path = os.path.join(location.path, CLAIM_NAME)
    if os.path.islink(path):  # never ours: a link is removed itself, its target left alone
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    aside = f"{path}.stale-{uuid.uuid4().hex[:8]}"
    with contextlib.suppress(FileNotFoundError):
        os.rename(path, aside)
        moved = {}
        with contextlib.suppress(Exception), open(aside, "rb") as f:
            moved = json.loads(f.read(4096))
        if isinstance(moved, dict) and moved.get("nonce") != stale_nonce:
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)  # a live claim: restore it
        os.unlink(aside)
