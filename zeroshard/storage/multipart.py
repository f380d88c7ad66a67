"""An S3 object written as a multipart upload whose parts upload concurrently.

s3fs's own file object uploads one part at a time, so a write runs at one stream's speed.
Here each full part is handed to s3fs's client (on fsspec's event loop) and the writer moves on
filling the next; at most `uploads_in_flight` parts are uploading at once. The object appears
only when commit() completes the upload after every part succeeded; discard() (or any failure)
stops the parts still uploading and aborts the upload, so no object and no pending multipart
upload is left behind. Every wait is bounded: requests are retried for at most
`zeroshard_retry_s` (s3_retry.py), and the abort is waited for at most ABORT_WAIT_S; an abort
that could not get through is reported (`maybe_pending`), never waited on for long.
A file smaller than one part is a single PUT at commit.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, wait
from typing import Any

from zeroshard.storage.remote_io import ABORT_WAIT_S, RemoteIO, part_size, submit


class ConcurrentMultipartUpload:
    """A write-only, file-like upload of one S3 object: write(), then commit() or discard().

    Errors are raised as the client raises them (OSError mostly); AtomicWriter turns them into
    StorageErrors naming the URL.
    """

    def __init__(self, fs: Any, path: str, settings: RemoteIO):
        self._fs, self._path, self._settings = fs, path, settings
        self._bucket, self._key, _ = fs.split_path(path)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._in_flight: deque[tuple[int, Future]] = deque()
        self._parts: list[dict[str, Any]] = []
        self._part_number = 0
        self.closed = False
        self.maybe_pending = False  # discard() could not confirm that the upload was aborted

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        while view:
            room = part_size(self._settings, self._part_number + 1) - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) >= part_size(self._settings, self._part_number + 1):
                self._send_part()
        return written

    def _send_part(self) -> None:
        if self._upload_id is None:
            upload = self._call("create_multipart_upload", Bucket=self._bucket, Key=self._key)
            self._upload_id = upload["UploadId"]
        while len(self._in_flight) >= self._settings.uploads_in_flight:
            self._collect_oldest()
        self._part_number += 1
        body, self._buffer = self._buffer, bytearray()  # the part owns its bytes: no copy
        future = submit(self._fs, "call_s3", "upload_part", Bucket=self._bucket, Key=self._key,
                        UploadId=self._upload_id, PartNumber=self._part_number, Body=body)
        self._in_flight.append((self._part_number, future))

    def _collect_oldest(self) -> None:
        number, future = self._in_flight.popleft()
        out = future.result()
        part = {"PartNumber": number, "ETag": out["ETag"]}
        for key in ("ChecksumCRC32", "ChecksumCRC32C", "ChecksumSHA1", "ChecksumSHA256", "ChecksumCRC64NVME"):
            if key in out:  # a checksum the client sent per part must be repeated when completing
                part[key] = out[key]
        self._parts.append(part)

    def _call(self, method: str, **kwargs: Any) -> Any:
        """One request, waited for (through the same path as the parts)."""
        return submit(self._fs, "call_s3", method, **kwargs).result()

    def in_flight(self) -> int:
        """Parts uploading now (for tests and diagnostics)."""
        return sum(not f.done() for _, f in self._in_flight)

    def close(self) -> None:
        """Nothing to do: the object appears at commit()."""

    def commit(self) -> None:
        """Make the object appear: upload what is left, wait for every part, complete."""
        if self._upload_id is None:
            self._call("put_object", Bucket=self._bucket, Key=self._key, Body=bytes(self._buffer))
        else:
            if self._buffer:
                self._send_part()
            while self._in_flight:
                self._collect_oldest()
            self._call("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                             UploadId=self._upload_id, MultipartUpload={"Parts": self._parts})
        self._buffer = bytearray()
        self.closed = True
        self._fs.invalidate_cache(self._path)

    def discard(self) -> None:
        """Abort, bounded in time: stop the parts in flight, then abort the upload so that S3
        keeps nothing. If the abort cannot be confirmed (S3 unreachable), `maybe_pending` is set:
        the upload may be left pending until `zeroshard clean` or the next run into the folder
        aborts it."""
        self._buffer = bytearray()
        self.closed = True
        futures = [f for _, f in self._in_flight]
        self._in_flight.clear()
        for future in futures:  # their bytes would be thrown away: stop sending them
            future.cancel()
        limit = min(self._settings.retry_s + 1.0, ABORT_WAIT_S)
        wait(futures, timeout=limit)  # a cancelled request ends at once; the abort comes after it
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        abort = submit(self._fs, "call_s3", "abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                       UploadId=upload_id)
        try:
            abort.result(timeout=limit)
        except FileNotFoundError:
            pass  # no such upload: already gone
        except Exception:  # unreachable or refused: say so (AtomicWriter adds it to the error)
            abort.cancel()
            self.maybe_pending = True


def is_s3(fs: Any) -> bool:
    """Whether `fs` is s3fs's filesystem (which this module drives through its client)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "s3" in protocols and hasattr(fs, "_call_s3") and hasattr(fs, "split_path")
