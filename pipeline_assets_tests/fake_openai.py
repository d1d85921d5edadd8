"""A fake OpenAI-compatible embeddings server for tests and benchmarks (stdlib + numpy only).

Thread mode: ``with FakeOpenAI(dim=16) as srv:``, a client on ``srv.base_url``, faults set directly
(``srv.fail_next(1, 429, retry_after="0.2")``). Process mode (benchmarks, multi-process tests):
``python -m pipeline_assets_tests.fake_openai --port 0 --dim 16 [--latency S] [--rpm N] [--tpm N]``
prints ``READY <base_url>`` and serves until SIGTERM. In both modes ``GET /_stats`` returns the stats
JSON (``?brief=1`` omits ``billed_by_text``) and ``POST /_faults`` takes the fields of
:meth:`FakeOpenAI.configure`.

How a request is answered: ``fake_openai_answers``; parsing, vectors, the HTTP handler and the admin
client (``fetch_stats``, ``post_faults``): ``fake_openai_wire``."""

from __future__ import annotations

import argparse
import collections
import copy
import random
import signal
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline_assets_tests.fake_openai_answers import Answering
from pipeline_assets_tests.fake_openai_wire import (
    FAULT_FIELDS,
    USAGE_COUNTERS,
    _Handler,
    _hard_close,
    _key,
    _Server,
    _vector,
)

if TYPE_CHECKING:
    from pipeline_assets.providers.openai_provider import OpenAIProvider


class FakeOpenAI(Answering):
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
        # What each marker and rate does: fake_openai_answers' docstring (the order a request meets them).
        self.drip_marker, self.drip_seconds = None, 60.0  # type: str | None, float
        self.random_faults: list = []  # [[probability, status, retry_after or None], ...]
        self.throttle_marker: str | None = None
        self.error_marker: str | None = None
        self.nan_marker: str | None = None
        # Probabilities per request, drawn from the fault_seed generator; 1.0: every request.
        self.drop_rate = self.slow_rate = self.short_rate = self.bad_index_rate = 0.0
        self.omit_marker: str | None = None
        # A request with an input containing hold_marker waits for release() (or stop()): a test
        # forces an interleaving with it instead of sleeping.
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
