"""A real S3-compatible server for tests: moto's server mode (``moto[server]``) as a child
process on 127.0.0.1, on a free port, with its request log kept (one line per request:
what the tests count to prove an object was or was not downloaded)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3

ACCESS_KEY = "testing-access-key"
SECRET_KEY = "testing-secret-key"
REGION = "us-east-1"
START_TIMEOUT = 60.0
_REQUEST = re.compile(r'"(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``with S3Server(log) as s3:`` a moto server; ``auth=True`` enforces credentials (every key is
    unknown to it, so any request is refused as bad credentials)."""

    def __init__(self, log: Path, *, port: int | None = None, auth: bool = False) -> None:
        self.log_path = log
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.auth = auth
        self.proc: subprocess.Popen | None = None

    def start(self) -> S3Server:
        env = {**os.environ, "MOTO_PORT": str(self.port)}
        if self.auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited: {self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"moto server did not listen on {self.port} within {START_TIMEOUT} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
        }

    def requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request served so far, in order."""
        self._log.flush()
        return [(m.group(1), m.group(2)) for m in map(_REQUEST.search, self.log_path.read_text().splitlines()) if m]

    def downloads(self, bucket: str) -> list[str]:
        """Keys of the objects downloaded (GET of an object, not a listing)."""
        prefix = f"/{bucket}/"
        return [
            path[len(prefix) :].split("?")[0]
            for method, path in self.requests()
            if method == "GET" and path.startswith(prefix) and len(path) > len(prefix)
        ]
