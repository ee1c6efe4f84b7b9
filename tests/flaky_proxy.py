"""An HTTP proxy on 127.0.0.1 in front of the test S3 server that fails chosen requests for a
while, as a throttling, overloaded or flapping store does: it answers 503 SlowDown, or drops the
connection without an answer. Every other request goes through unchanged."""
from __future__ import annotations

import http.client
import math
import socket
import socketserver
import threading
import time
from dataclasses import dataclass

SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {n}\r\n"
             b"Connection: close\r\n\r\n")
SLOW_DOWN_BODY = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>"
                  b"<Message>Please reduce your request rate.</Message></Error>")


@dataclass
class Fault:
    match: tuple[str, ...]  # a request fails when its path contains each of these
    how: str  # "503" or "drop"
    seconds: float = math.inf  # how long after the first failed request the store is back
    until: float = math.inf  # then: time.monotonic() at which it is back
    failed: int = 0  # the requests it failed

    def fails(self, path: str) -> bool:
        if not all(part in path for part in self.match):
            return False
        if self.until == math.inf:
            self.until = time.monotonic() + self.seconds
        if time.monotonic() < self.until:
            self.failed += 1
            return True
        return False


class FlakyProxy(socketserver.ThreadingTCPServer):
    """Several faults may be armed at once, each on the requests it matches (a run's own prefix), for
    several runs of one launch."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream_port, self.faults = upstream_port, []
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def fail(self, match: tuple[str, ...], how: str, seconds: float = math.inf) -> Fault:
        """From the first request whose path contains each part of `match`, fail those for `seconds`."""
        fault = Fault(match, how, seconds)
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Every request goes through again."""
        self.faults = []

    def faulty(self, path: str) -> str | None:
        return next((fault.how for fault in self.faults if fault.fails(path)), None)


class _Handler(socketserver.StreamRequestHandler):
    server: FlakyProxy

    def handle(self) -> None:
        while request := self._read_request():
            method, path, head, body = request
            how = self.server.faulty(path)
            if how == "drop":
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if how == "503":
                self.wfile.write(SLOW_DOWN.replace(b"{n}", str(len(SLOW_DOWN_BODY)).encode()) + SLOW_DOWN_BODY)
                return
            self.wfile.write(self._forward(method, head, body))

    def _read_request(self) -> tuple[str, str, bytes, bytes] | None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = self.rfile.readline()
            if not line:
                return None
            head += line
        method, path = head.split(b" ", 2)[:2]
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)}
        if headers.get(b"expect", b"").lower() == b"100-continue":  # botocore's PUTs wait for it
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            body = self._read_chunked()
        else:
            body = self.rfile.read(int(headers.get(b"content-length", b"0")))
        return method.decode(), path.decode(), head, body

    def _read_chunked(self) -> bytes:
        raw = b""
        while True:
            size_line = self.rfile.readline()
            raw += size_line
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                while (trailer := self.rfile.readline()) not in (b"\r\n", b""):
                    raw += trailer
                return raw + b"\r\n"
            raw += self.rfile.read(size + 2)

    def _forward(self, method: str, head: bytes, body: bytes) -> bytes:
        """One upstream connection per request: the answer, re-framed with a Content-Length."""
        with socket.create_connection(("127.0.0.1", self.server.upstream_port)) as upstream:
            upstream.sendall(head + body)
            response = http.client.HTTPResponse(upstream, method=method)
            response.begin()
            content = response.read()
            lines = [f"HTTP/1.1 {response.status} {response.reason}"]
            for name, value in response.getheaders():
                if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                    lines.append(f"{name}: {value}")
            length = response.getheader("content-length") if method == "HEAD" else str(len(content))
            lines.append(f"Content-Length: {length or 0}")
            return ("\r\n".join(lines) + "\r\n\r\n").encode("latin1") + content
