"""Signed checkpoints: an HMAC-SHA256, under a key the user holds, over the exact manifest bytes
and the SHA-256 of every file the manifest lists (docs/SAFETY.md says what this does and does
not promise).

Why SHA-256 of each file and not only the manifest: the manifest's own hashes are XXH3-64, made
to catch accidents, not forgers (a collision can be constructed). SHA-256 is what binds the
bytes; the HMAC binds those digests to the key. Only the standard library is used.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from zeroshard.errors import CheckpointError

SIGNATURE_NAME = "zeroshard.json.sig"
ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16
MAX_SIGNATURE_BYTES = 1 << 20


def key_id(key: bytes) -> str:
    """A short public fingerprint of the key (which key signed), revealing nothing usable."""
    return hashlib.sha256(b"zeroshard-key-id:" + key).hexdigest()[:16]


def _mac(key: bytes, body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def make_signature(key: bytes, manifest_bytes: bytes, file_digests: dict[str, str]) -> bytes:
    """The signature file's bytes."""
    body = {"algorithm": ALGORITHM, "key_id": key_id(key),
            "manifest_sha256": hashlib.sha256(manifest_bytes).hexdigest(),
            "files_sha256": dict(sorted(file_digests.items()))}
    return (json.dumps({**body, "signature": _mac(key, body)}, indent=2) + "\n").encode()


def check_signature(key: bytes, raw: bytes, manifest_bytes: bytes, where: str) -> dict[str, str]:
    """Check the signature file `raw` against the key and the manifest bytes; returns the signed
    SHA-256 of each file, which the caller must compare with the files' actual bytes."""
    if len(raw) > MAX_SIGNATURE_BYTES:
        raise CheckpointError(where, f"signature file is over {MAX_SIGNATURE_BYTES} bytes: not a zeroshard signature")
    try:
        doc = json.loads(raw)
        body = {k: doc[k] for k in ("algorithm", "key_id", "manifest_sha256", "files_sha256")}
        signature = doc["signature"]
        ok = isinstance(signature, str) and isinstance(body["files_sha256"], dict)
    except (ValueError, KeyError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise CheckpointError(where, "not a valid zeroshard signature file")
    if body["algorithm"] != ALGORITHM:
        raise CheckpointError(where, f"signature algorithm {str(body['algorithm'])[:40]!r} is not {ALGORITHM!r}")
    if not hmac.compare_digest(_mac(key, body), signature):
        hint = " (signed with another key)" if body["key_id"] != key_id(key) else " (signature file altered)"
        raise CheckpointError(where, "signature does not match this key" + hint)
    if body["manifest_sha256"] != hashlib.sha256(manifest_bytes).hexdigest():
        raise CheckpointError(where, "the manifest was changed after it was signed")
    return {str(k): str(v) for k, v in body["files_sha256"].items()}


def read_key(path: str) -> bytes:
    """The key in a key file (surrounding whitespace ignored); refuses short keys."""
    try:
        with open(path, "rb") as f:
            key = f.read(1 << 16).strip()
    except OSError as exc:
        raise CheckpointError(path, f"cannot read key file ({exc.strerror or exc})") from None
    if len(key) < MIN_KEY_BYTES:
        raise CheckpointError(path, f"key is {len(key)} bytes; use at least {MIN_KEY_BYTES} random bytes "
                                    f"(e.g. `head -c 32 /dev/urandom | base64 > {path}`)")
    return key
