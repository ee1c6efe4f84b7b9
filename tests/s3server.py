"""A real S3-compatible server for the tests: moto's server mode on 127.0.0.1, in this process,
with a log of every request it answers (to count GETs of data objects)."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server


@dataclass
class RequestLog:
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def middleware(self, app):
        def logged(environ, start_response):
            with self.lock:
                self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")))
            return app(environ, start_response)
        return logged

    def gets(self, prefix: str) -> int:
        """GETs of objects under /bucket/prefix (object reads, not listings)."""
        with self.lock:
            return sum(1 for method, path in self.requests if method == "GET" and path.startswith(prefix))

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()


class S3Server(ThreadedMotoServer):
    """Stop and start again on the same port: moto keeps its buckets in this process meanwhile,
    as a real store keeps its objects through an outage."""

    def __init__(self, port: int) -> None:
        super().__init__(ip_address="127.0.0.1", port=port, verbose=False)
        self.log = RequestLog()
        self.port, self.endpoint = port, f"http://127.0.0.1:{port}"
        # Credentials unique to this run, so a test can search every output for them.
        self.key_id = f"AKIATEST{secrets.token_hex(6).upper()}"
        self.secret = f"secret-{secrets.token_hex(16)}"

    def start(self) -> None:
        """moto's, with a deadline: a port that cannot be bound is an error, not a wait for good. fsspec
        keeps one s3fs instance per set of arguments, and the endpoint (AWS_ENDPOINT_URL, set per test)
        is not among them: an instance made for an earlier server in this process would call its dead
        port ("Could not connect to the endpoint URL"), so a new server starts with none cached."""
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        self._thread = threading.Thread(target=self._server_entry, daemon=True)
        self._thread.start()
        if not self._server_ready_event.wait(30):
            raise RuntimeError(f"the S3 server did not start on {self.endpoint} within 30 s")

    def _server_entry(self) -> None:
        app = self.log.middleware(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()

    def env(self) -> dict[str, str]:
        """What a client needs: the standard variables every AWS SDK reads."""
        return {"AWS_ACCESS_KEY_ID": self.key_id, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    @contextlib.contextmanager
    def authenticating(self) -> Iterator[None]:
        """Signatures checked while inside (moto's authentication, off otherwise): a key that moto's IAM
        does not know is refused, as a real store refuses a wrong key. Through moto's own switch for
        server mode (POST /moto-api/reset-auth: how many requests pass unchecked from now on)."""
        unchecked = self._reset_auth("0")
        try:
            yield
        finally:
            self._reset_auth(unchecked)

    def _reset_auth(self, unchecked: str) -> str:
        """Let `unchecked` more requests pass without authentication; the count before."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=unchecked.encode(), method="POST",
                                         headers={"Content-Type": "text/plain"})  # not a form: moto reads the body
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key_id,
                            aws_secret_access_key=self.secret, region_name="us-east-1")

    def upload_tree(self, bucket: str, prefix: str, root: os.PathLike) -> None:
        """Every file under `root`, keyed by its relative path under `prefix`."""
        client = self.client()
        for dirpath, _, files in os.walk(root):
            for name in files:
                path = os.path.join(dirpath, name)
                key = f"{prefix}/{os.path.relpath(path, root)}".lstrip("/")
                client.upload_file(path, bucket, key)
