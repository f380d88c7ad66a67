"""A fault-injecting HTTP proxy on 127.0.0.1 in front of the moto S3 server (tests only).

Every request is forwarded unchanged unless `rule(method, path, query)` returns a fault:
  ("status", 500)       answer with that status and an S3-style error body, forwarding nothing
                        (code SlowDown for a 503, as S3 throttles; InternalError otherwise);
  ("drop", n)           read n bytes of the request body, then close the connection unanswered,
                        as a dropped network connection does mid-upload;
  ("hang", 0)           read the whole request, then never answer (until the client gives up);
  ("lose_answer", 0)    forward the request, then close the connection without passing on the
                        answer: the request took effect, the client cannot know.
`requests` records (method, path, query, fault) of everything seen; `faulted_at` the
time.monotonic() of each fault.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

Rule = Callable[[str, str, str], "tuple[str, int] | None"]


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.rule: Rule = lambda method, path, query: None
        self.requests: list[tuple[str, str, str, object]] = []
        self.faulted_at: list[float] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self, limit: int | None = None) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return data
                        data += self.rfile.read(size)
                        self.rfile.readline()
                        if limit is not None and len(data) >= limit:
                            return data
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length if limit is None else min(limit, length))

            def _handle(self) -> None:
                path, _, query = self.path.partition("?")
                fault = proxy.rule(self.command, path, query)
                proxy.requests.append((self.command, path, query, fault))
                if fault:
                    proxy.faulted_at.append(time.monotonic())
                if fault and fault[0] == "hang":
                    self._body()
                    self.connection.settimeout(120)
                    self.rfile.read(1)  # returns when the client closes the connection
                    self.close_connection = True
                    return
                if fault and fault[0] == "drop":
                    self._body(limit=fault[1])
                    self.close_connection = True
                    self.connection.close()
                    return
                body = self._body()
                if fault and fault[0] == "status":
                    # a 503 is S3's throttling answer (SlowDown); any other status an InternalError
                    code = b"SlowDown" if fault[1] == 503 else b"InternalError"
                    payload = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>" + code + b"</Code>"
                               b"<Message>injected fault</Message></Error>")
                    self.send_response(fault[1])
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                if fault and fault[0] == "lose_answer":
                    upstream.close()
                    self.close_connection = True
                    self.connection.close()
                    return
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date"):
                        self.send_header(key, value)
                length = response.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)  # a HEAD tells the object's size, sends no body
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        class Server(ThreadingHTTPServer):
            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a client that gave up on a request closed its connection: not news

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
