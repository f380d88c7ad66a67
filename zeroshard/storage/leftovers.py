"""Leftovers of writers that died: hidden temp files and staging folders, claims, and (S3)
pending multipart uploads. Found here, judged stale here, removed by `zeroshard clean` or by
the next run into the same output.

Stale means: its owner was a process of this host that is gone, or (owner unknown: another
host, an S3 upload) it is older than the age given. A live writer's leftover is never stale.
A staging folder that holds a complete new checkpoint whose swap into place was interrupted is
never removed (see docs/SAFETY.md): it may be the only complete copy.

One more kind has no hidden name: the output files of a writer that wrote straight into an
empty folder (an S3 output; a local one by zeroshard before 0.1.1) and died before its commit
file. They are recognized by the dead writer's claim beside them, our output names (rank files,
HF shards `model-N-of-M`), and no commit file (manifest, HF index) nor interrupted swap there;
they take the claim's owner and age. A claim marked torn (storage.claim) has no live writer:
a checkpoint save that lost a peer left it, with the rank files its surviving ranks wrote.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable

from zeroshard.storage.claim import CLAIM_NAME, writer_alive
from zeroshard.storage.describe import describe_error
from zeroshard.storage.location import TEMP_PREFIX, Location, storage_errors
from zeroshard.storage.owner import owner_alive, owner_of_temp

# Written into a staging folder just before its output swaps in (format.output): from then on
# the stage may hold the only copy of part of the new output, and is never removed as stale.
SWAP_MARKER = ".zeroshard-swapping"
KEEP_REASON = "its swap into place was interrupted: it holds part of the new output; move its files up"
# What an output writer names its files, and the files that commit them (format.manifest and
# format.full_model spell them; repeated here, below the format layer). A single `model.safetensors`
# has no commit file, so it is never taken for an uncommitted output.
_OUTPUT_FILE = re.compile(r"^rank-\d{5,}-of-\d{5,}\.safetensors$|^model-\d{5}-of-\d{5}\.safetensors$")
_COMMIT_FILES = ("zeroshard.json", "model.safetensors.index.json")


@dataclass
class Leftover:
    url: str
    kind: str  # "temp file", "staging folder", "claim", "multipart upload", "uncommitted file"
    size: int
    age_s: float | None
    alive: bool | None  # its owner process: True/False on this host, None when unknown
    remove: Callable[[], None] = field(repr=False)
    keep: str = ""  # why it must stay whatever its age

    def stale(self, older_than_s: float) -> bool:
        if self.keep or self.alive:
            return False
        return self.alive is False or (self.age_s is not None and self.age_s >= older_than_s)


def find_leftovers(location: Location, recursive: bool = True,
                   unreadable: list[str] | None = None) -> list[Leftover]:
    """Every leftover under `location` (only its direct children unless recursive).

    `unreadable`: when given, a local folder below `location` that cannot be examined (listed,
    or its entries stat'ed: permission denied, an I/O error) is skipped and named there, one line
    each, so that the leftovers of every other folder are still found. Without it, and for
    `location` itself, that failure raises a StorageError."""
    with storage_errors(location.url):
        if location.local:
            return _find_local(location, location.path, recursive, unreadable)
        return _find_remote(location, recursive) + _find_uploads(location, recursive)


def remove_leftovers_of_others(location: Location, took_over: bool = False) -> list[Leftover]:
    """For a writer that has just claimed `location`, before it writes: remove the leftovers
    directly in it. The claim shuts out every other zeroshard writer, so whatever is here belongs
    to a dead one; only a live process of this host (an older zeroshard?) and an interrupted swap
    are spared. `took_over`: the claim was taken over from an earlier writer (Claim.took_over);
    then output files without a commit file are that writer's and go too (nobody commits them,
    and a save at another world size would otherwise leave them beside its own). Without a claim
    before ours nothing says whose such files are, and they stay. Returns the interrupted swaps
    it spared (their `keep` says why)."""
    kept = []
    for leftover in find_leftovers(location, recursive=False):
        if leftover.keep:
            kept.append(leftover)
        elif leftover.kind != "claim" and (leftover.alive is not True
                                           or (took_over and leftover.kind == "uncommitted file")):
            leftover.remove()
    return kept


# ---- local ---------------------------------------------------------------------------------
def _find_local(location: Location, path: str, recursive: bool,
                unreadable: list[str] | None = None) -> list[Leftover]:
    out: list[Leftover] = []
    try:
        entries = [entry for entry in os.scandir(path) if _stat(entry)]
    except (FileNotFoundError, NotADirectoryError):
        return out
    except OSError as exc:
        if unreadable is None or path == location.path:
            raise
        unreadable.append(_not_examined(location, path, exc))
        return out
    now = time.time()
    for entry in entries:
        url = location.url + "/" + os.path.relpath(entry.path, location.path).replace(os.sep, "/")
        st = entry.stat(follow_symlinks=False)
        if entry.name.startswith(TEMP_PREFIX):  # See [Note: temp names] (location.py)
            alive = owner_alive(owner_of_temp(entry.name, TEMP_PREFIX))
            if entry.is_dir(follow_symlinks=False):
                size, newest, failure = _tree_size_and_mtime(entry.path)
                if failure is not None and unreadable is not None:
                    # neither its age nor an interrupted swap's marker can be known: not judged
                    unreadable.append(_not_examined(location, *failure))
                    continue
                out.append(Leftover(url, "staging folder", size, now - max(newest, st.st_mtime), alive,
                                    _rmtree(entry.path), _keep_reason(entry.path, os.path.dirname(entry.path))))
            else:
                out.append(Leftover(url, "temp file", st.st_size, now - st.st_mtime, alive, _unlink(entry.path)))
        elif entry.name == CLAIM_NAME or entry.name.startswith(CLAIM_NAME + ".stale-"):
            doc = {} if entry.is_symlink() else _claim_doc(entry.path)
            alive = False if entry.name != CLAIM_NAME else writer_alive(doc)
            out.append(Leftover(url, "claim", st.st_size, now - st.st_mtime, alive, _unlink(entry.path)))
        elif recursive and entry.is_dir(follow_symlinks=False):  # never into a link: it leads elsewhere
            out.extend(_find_local(location, entry.path, recursive, unreadable))
    return out + _uncommitted(out, {e.name: e for e in entries}, location.url + "/"
                              + os.path.relpath(path, location.path).replace(os.sep, "/"), now)


def _stat(entry: os.DirEntry) -> bool:
    """Stat `entry` (DirEntry keeps it: later stat(follow_symlinks=False) calls are free); False
    if it was removed meanwhile. Other errors are the folder's: without x, none of its entries can
    be stat'ed."""
    try:
        entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _uncommitted(found: list[Leftover], entries: dict[str, os.DirEntry], url: str, now: float) -> list[Leftover]:
    """Output files a dead writer put straight into this folder before its commit (module docstring)."""
    url = url[:-2] if url.endswith("/.") else url
    claim = next((x for x in found if x.kind == "claim" and x.url == f"{url}/{CLAIM_NAME}"), None)
    if claim is None or any(name in entries for name in _COMMIT_FILES) or any(
            x.keep and x.url.rsplit("/", 1)[0] == url for x in found):
        return []
    out = []
    for name, entry in entries.items():
        if _OUTPUT_FILE.match(name) and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            age = _younger(now - st.st_mtime, claim.age_s)
            out.append(Leftover(f"{url}/{name}", "uncommitted file", st.st_size, age, claim.alive, _unlink(entry.path)))
    return out


def _not_examined(location: Location, path: str, exc: OSError) -> str:
    """One line naming a folder that could not be examined, and what that means for it."""
    url = location.url + "/" + os.path.relpath(path, location.path).replace(os.sep, "/")
    return f"{url}: {describe_error(exc)} (not examined: nothing in it was cleaned)"


def _tree_size_and_mtime(path: str) -> tuple[int, float, tuple[str, OSError] | None]:
    """Size and newest mtime of a tree, and the first folder in it that could not be read, with
    why (None: all read; what was removed meanwhile does not count)."""
    size, newest = 0, 0.0
    failures: list[tuple[str, OSError]] = []

    def failed(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            failures.append((exc.filename or path, exc))

    for folder, _, files in os.walk(path, onerror=failed):  # os.walk does not follow links by default
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            except OSError as exc:  # a folder that lists but cannot be searched (no x)
                failures.append((folder, exc))
                continue
            size += st.st_size
            newest = max(newest, st.st_mtime)
    return size, newest, failures[0] if failures else None


def _keep_reason(stage: str, target: str) -> str:
    return KEEP_REASON if os.path.exists(os.path.join(stage, SWAP_MARKER)) else ""


def _claim_doc(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(4096))
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _unlink(path: str) -> Callable[[], None]:
    def remove() -> None:
        with storage_errors(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return remove


def _rmtree(path: str) -> Callable[[], None]:
    def remove() -> None:
        import shutil

        with storage_errors(path):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)  # rmtree never follows links inside the tree
    return remove


# ---- object stores ---------------------------------------------------------------------------
def _find_remote(location: Location, recursive: bool) -> list[Leftover]:
    fs, root = location.fs, location.path.rstrip("/")
    try:
        found = fs.find(root, detail=True, withdirs=False, maxdepth=None if recursive else 2)
    except FileNotFoundError:
        return []
    now = time.time()
    groups: dict[str, list[dict]] = {}
    out: list[Leftover] = []
    for key, info in found.items():
        parts = key[len(root):].strip("/").split("/")
        hit = next((i for i, p in enumerate(parts) if p.startswith(TEMP_PREFIX)), None)
        if hit is not None and (recursive or hit == 0):
            groups.setdefault("/".join(parts[:hit + 1]), []).append(info)
        elif parts[-1] == CLAIM_NAME and (recursive or len(parts) == 1):
            doc = {}
            try:
                doc = json.loads(fs.cat_file(key, start=0, end=4096))
                doc = doc if isinstance(doc, dict) else {}
            except Exception:
                pass
            out.append(Leftover(f"{location.url}/{'/'.join(parts)}", "claim", int(info.get("size") or 0),
                                _age(info, now), writer_alive(doc), _rm(fs, key)))
    out.extend(_uncommitted_remote(fs, location, root, found, out, groups, now))
    for rel, infos in groups.items():
        name = rel.rsplit("/", 1)[-1]
        full = f"{root}/{rel}"
        is_folder = any(i["name"].rstrip("/") != full for i in infos)
        ages = [a for a in (_age(i, now) for i in infos) if a is not None]
        keep = KEEP_REASON if is_folder and any(i["name"].endswith("/" + SWAP_MARKER) for i in infos) else ""
        out.append(Leftover(f"{location.url}/{rel}", "staging folder" if is_folder else "temp file",
                            sum(int(i.get("size") or 0) for i in infos), min(ages) if ages else None,
                            owner_alive(owner_of_temp(name, TEMP_PREFIX)), _rm(fs, full, recursive=is_folder), keep))
    return out


def _uncommitted_remote(fs, location: Location, root: str, found: dict, claims: list[Leftover],
                        stages: dict[str, list[dict]], now: float) -> list[Leftover]:
    """Object-store twin of _uncommitted: per folder holding a claim."""
    out = []
    for claim in claims:
        folder = claim.url[len(location.url):].strip("/").rpartition("/")[0]  # relative, "" for the root
        prefix = f"{folder}/" if folder else ""
        swapping = any(rel.startswith(prefix) and "/" not in rel[len(prefix):]
                       and any(i["name"].endswith("/" + SWAP_MARKER) for i in infos) for rel, infos in stages.items())
        names = {key[len(root):].strip("/")[len(prefix):]: (key, info) for key, info in found.items()
                 if key[len(root):].strip("/").startswith(prefix)}
        if swapping or any(name in names for name in _COMMIT_FILES):
            continue
        for name, (key, info) in names.items():
            if "/" not in name and _OUTPUT_FILE.match(name):
                age = _age(info, now)
                out.append(Leftover(f"{location.url}/{prefix}{name}", "uncommitted file", int(info.get("size") or 0),
                                    _younger(age, claim.age_s), claim.alive, _rm(fs, key)))
    return out


def _younger(a: float | None, b: float | None) -> float | None:
    """The more recent of two ages: the writer was active then (an unknown age is ignored)."""
    return min(a, b) if a is not None and b is not None else a if b is None else b


def _find_uploads(location: Location, recursive: bool) -> list[Leftover]:
    """Pending multipart uploads under the prefix (s3 only): never completed, never visible,
    but stored and billed until aborted."""
    fs = location.fs
    if not hasattr(fs, "call_s3"):
        return []
    bucket, _, prefix = location.path.strip("/").partition("/")
    prefix = f"{prefix}/" if prefix else ""
    out: list[Leftover] = []
    now = time.time()
    kwargs = {"Bucket": bucket, "Prefix": prefix}
    while True:
        page = fs.call_s3("list_multipart_uploads", **kwargs)
        for upload in page.get("Uploads", []):
            key = upload["Key"]
            rest = key[len(prefix):]
            if not recursive and "/" in rest and not rest.startswith(TEMP_PREFIX):
                continue  # deeper, and not inside one of this folder's stages
            initiated = upload.get("Initiated")
            age = now - initiated.timestamp() if hasattr(initiated, "timestamp") else None

            def abort(key: str = key, upload_id: str = upload["UploadId"]) -> None:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)

            out.append(Leftover(f"s3://{bucket}/{key} (upload {upload['UploadId'][:12]})", "multipart upload",
                                0, age, None, abort))
        if not page.get("IsTruncated"):
            return out
        kwargs.update(KeyMarker=page.get("NextKeyMarker"), UploadIdMarker=page.get("NextUploadIdMarker"))


def _age(info: dict, now: float) -> float | None:
    modified = info.get("LastModified") or info.get("mtime")
    return now - modified.timestamp() if hasattr(modified, "timestamp") else None


def _rm(fs, path: str, recursive: bool = False) -> Callable[[], None]:
    def remove() -> None:
        with storage_errors(path):
            fs.rm(path, recursive=recursive)
    return remove
