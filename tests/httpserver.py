"""A local HTTP server for download tests: serves a folder on 127.0.0.1, as slowly as asked, and
counts the GETs of each path. It can also cut every response in the middle."""
from __future__ import annotations

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FileServer:
    def __init__(self, folder: Path, bytes_per_s: float = 0, cut: bool = False) -> None:
        self.folder, self.bytes_per_s, self.cut = folder, bytes_per_s, cut
        self.gets: Counter[str] = Counter()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                server.gets[self.path] += 1
                path = server.folder / self.path.lstrip("/")
                if not path.is_file():
                    self.send_error(404)
                    return
                body = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                server.send(self.wfile, body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def send(self, out, body: bytes) -> None:
        chunk = 16 * 1024
        end = len(body) // 2 if self.cut else len(body)
        for start in range(0, end, chunk):
            out.write(body[start:min(start + chunk, end)])
            if self.bytes_per_s:
                time.sleep(chunk / self.bytes_per_s)  # a slow server on purpose (its bytes per second)

    def __enter__(self) -> "FileServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
