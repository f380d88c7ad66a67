"""Is an output the input under another name? Compared by resolved identity, not by spelling.

`ck/.`, `ck/../ck`, a symlink to `ck`, a rank file of `ck`, or a parent of `ck` all name (part
of) the same bytes as `ck`; an `--overwrite` into any of them would replace the input. Locally
paths are compared after os.path.realpath (symlinks and `..` resolved, the missing tail of a
not-yet-existing output kept as spelled); on object stores, by protocol and normalized
bucket/key. Outputs and inputs on different filesystems never overlap.
"""

from __future__ import annotations

import os
import posixpath

from zeroshard.errors import ZeroshardError
from zeroshard.storage.location import Location, _protocols


def identity(location: Location, name: str = "") -> tuple[str, str]:
    """(filesystem, canonical path) of `location` (or of `name` inside it)."""
    path = posixpath.join(location.path, name) if name else location.path
    if location.local:
        return "file", os.path.realpath(path)
    proto = _protocols(location.fs)[0]
    return proto, posixpath.normpath("/" + path.strip("/"))


def _overlap(a: tuple[str, str], b: tuple[str, str]) -> str | None:
    """How path a relates to path b: 'is', 'is inside', 'contains', or None."""
    if a[0] != b[0]:
        return None
    if a[1] == b[1]:
        return "is"
    common = posixpath.commonpath([a[1], b[1]]) if a[1].startswith("/") == b[1].startswith("/") else ""
    if common == b[1]:
        return "is inside"
    if common == a[1]:
        return "contains"
    return None


def _inode_chain(path: str) -> list[tuple[int, int]]:
    """(device, inode) of `path` (if it exists) and of every existing folder above it: catches
    the same folder reached by two paths that realpath cannot equate (bind mounts, a
    case-insensitive filesystem)."""
    chain = []
    while True:
        try:
            st = os.stat(path)
            chain.append((st.st_dev, st.st_ino))
        except OSError:
            pass
        parent = os.path.dirname(path)
        if parent == path:
            return chain
        path = parent


def _local_overlap(out_path: str, in_path: str) -> str | None:
    out_chain, in_chain = _inode_chain(out_path), _inode_chain(in_path)
    if not in_chain:
        return None
    if os.path.exists(out_path) and out_chain and out_chain[0] == in_chain[0]:
        return "is"
    if in_chain[0] in out_chain:
        return "is inside"
    if os.path.exists(out_path) and out_chain and out_chain[0] in in_chain:
        return "contains"
    return None


def check_output_apart(output: Location, inputs: list[Location], output_name: str = "") -> None:
    """Refuse an output that is, is inside, or contains any input file or folder.

    `output_name`: the output is the file `name` inside `output` (e.g. consolidate's .safetensors).
    """
    out_id = identity(output, output_name)
    out_url = output.url_of(output_name)
    for source in inputs:
        in_id = identity(source)
        relation = _overlap(out_id, in_id)
        if relation is None and out_id[0] == in_id[0] == "file":
            relation = _local_overlap(out_id[1], in_id[1])
        if relation:
            raise ZeroshardError(f"{out_url}: output {relation} the input {source.url} (resolved: {out_id[1]}); "
                                 f"the output must differ from the input and not overlap it")
