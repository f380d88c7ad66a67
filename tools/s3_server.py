"""A local S3 endpoint (moto's server) on 127.0.0.1, for tests and for trying zeroshard with s3://.

    python tools/s3_server.py [--port 5555] [--bucket ckpt]

prints `S3 endpoint http://127.0.0.1:PORT` once it is ready, then serves until killed. Point
zeroshard at it with AWS_ENDPOINT_URL=http://127.0.0.1:PORT AWS_ACCESS_KEY_ID=testing
AWS_SECRET_ACCESS_KEY=testing (moto accepts any credentials). State lives in memory only.

--lean-ranges makes a ranged GET read only the range asked for. Stock moto reads the whole
object for every ranged GET and slices it (moto/s3/responses.py: get_object returns key.value,
_handle_range_header slices it), so a 16 MiB range of a 60 MB object costs the server a 60 MB
read: an artefact that real S3 does not have and that swamps benchmarks of ranged reads.

--latency-ms and --stream-mbps make each request behave more like one to S3 over a network: a
fixed delay before it is answered, and its body (sent or received) paced to at most that many
MB/s. The pacing sleeps, so concurrent requests proceed side by side as they do against S3,
where one connection is limited but many add up. Both are off by default (tests use neither).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--bucket", action="append", default=[], help="bucket to create (repeatable)")
    parser.add_argument("--lean-ranges", action="store_true", help="ranged GETs read only their range (see above)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="delay before each request is answered")
    parser.add_argument("--stream-mbps", type=float, default=0.0, help="pace each request's body to this many MB/s")
    args = parser.parse_args()
    from moto.server import ThreadedMotoServer

    if args.lean_ranges:
        lean_ranged_gets()
    if args.latency_ms or args.stream_mbps:
        pace_requests(args.latency_ms / 1000, args.stream_mbps * 1e6)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=args.port, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    if args.bucket:
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        for bucket in args.bucket:
            client.create_bucket(Bucket=bucket)
    print(f"S3 endpoint {endpoint}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        sys.stdout.flush()
        os._exit(0)


class _LazyValue:
    """An object's bytes as moto's range handling uses them (len and one slice), read on demand."""

    def __init__(self, key):
        self._key = key

    def __len__(self) -> int:
        return self._key.size

    def __getitem__(self, window: slice) -> bytes:
        start, stop, _ = window.indices(self._key.size)
        with self._key.lock:
            self._key._value_buffer.seek(start)
            return self._key._value_buffer.read(max(0, stop - start))


def lean_ranged_gets() -> None:
    import threading

    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    ranged = threading.local()  # set while moto's server thread answers a ranged GET
    whole_value, whole_get, slice_range = FakeKey.value, S3Response.get_object, S3Response._handle_range_header

    def value(key):
        return _LazyValue(key) if getattr(ranged, "on", False) else whole_value.fget(key)

    def get_object(self):
        asked = str(self.headers.get("range", ""))
        ranged.on = asked.startswith("bytes=") and "," not in asked
        try:
            return whole_get(self)
        finally:
            ranged.on = False

    def handle_range_header(self, request, response_headers, response_content):
        status, headers, body = slice_range(self, request, response_headers, response_content)
        return status, headers, body[:] if isinstance(body, _LazyValue) else body  # a range moto ignored

    FakeKey.value = property(value, whole_value.fset)
    S3Response.get_object = get_object
    S3Response._handle_range_header = handle_range_header


class _Pace:
    """Sleeps so that the bytes counted so far take at least bytes / rate seconds."""

    def __init__(self, rate: float):
        self.rate, self.start, self.bytes = rate, time.perf_counter(), 0

    def __call__(self, n: int) -> None:
        self.bytes += n
        if self.rate:
            ahead = self.start + self.bytes / self.rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)


class _PacedInput:
    def __init__(self, stream, pace: _Pace):
        self._stream, self._pace = stream, pace

    def read(self, *args):
        data = self._stream.read(*args)
        self._pace(len(data))
        return data

    def readline(self, *args):
        line = self._stream.readline(*args)
        self._pace(len(line))
        return line

    def __iter__(self):
        return iter(self.readline, b"")


def pace_requests(latency: float, rate: float) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    dispatch = DomainDispatcherApplication.__call__

    def paced(self, environ, start_response):
        time.sleep(latency)
        pace = _Pace(rate)
        environ["wsgi.input"] = _PacedInput(environ["wsgi.input"], pace)
        for chunk in dispatch(self, environ, start_response):
            for i in range(0, len(chunk), 1 << 20):  # in 1 MiB pieces, so the pace is smooth
                pace(len(chunk[i:i + (1 << 20)]))
                yield chunk[i:i + (1 << 20)]

    DomainDispatcherApplication.__call__ = paced


if __name__ == "__main__":
    main()
