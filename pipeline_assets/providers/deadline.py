"""A hard wall-clock deadline on a whole HTTP call.

Every socket operation of a call gets at most the time left until the call's deadline, and none
starts once it has passed: the call ends at its deadline with an ordinary ``ReadTimeout`` (the SDK's
``APITimeoutError``), even for an answer that trickles in a byte at a time (httpx alone times out
per read). The SDK's connection pools get a network backend (httpcore's extension point) whose
streams clamp each operation to the deadline of the call on the current thread (:func:`within`).
Not bounded: DNS resolution and TLS inside TLS (an ``https://`` proxy), bounded per read only.
"""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpcore2
import httpx2

_current = threading.local()  # .deadline: monotonic deadline of the call on this thread, or absent


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Run the HTTP calls of this block (on this thread) under one deadline."""
    previous = getattr(_current, "deadline", None)
    _current.deadline = time.monotonic() + seconds
    try:
        yield
    finally:
        _current.deadline = previous


def _clamp(timeout: float | None, expired: type[Exception]) -> float | None:
    """The timeout of one socket operation: at most the time left of the call."""
    deadline = getattr(_current, "deadline", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the call's wall-clock deadline has passed")
    return left if timeout is None else min(timeout, left)


class DeadlineStream(httpcore2.NetworkStream):
    def __init__(self, inner: httpcore2.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _clamp(timeout, httpcore2.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _clamp(timeout, httpcore2.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore2.NetworkStream:
        return DeadlineStream(
            self._inner.start_tls(ssl_context, server_hostname, _clamp(timeout, httpcore2.ConnectTimeout))
        )

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class DeadlineBackend(httpcore2.NetworkBackend):
    def __init__(self, inner: httpcore2.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore2.SOCKET_OPTION] | None = None,
    ) -> httpcore2.NetworkStream:
        return DeadlineStream(
            self._inner.connect_tcp(
                host, port, _clamp(timeout, httpcore2.ConnectTimeout), local_address, socket_options
            )
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[httpcore2.SOCKET_OPTION] | None = None
    ) -> httpcore2.NetworkStream:
        return DeadlineStream(
            self._inner.connect_unix_socket(path, _clamp(timeout, httpcore2.ConnectTimeout), socket_options)
        )

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def install(client: httpx2.Client) -> httpx2.Client:
    """Put every connection pool of ``client`` (its default transport and any
    proxy mounts from the environment) under the deadline backend.

    httpx builds its pools itself and exposes no backend option, so this reaches
    into ``Client._transport``/``_mounts`` and the pools' ``_network_backend``;
    a release that renames them fails here, at construction, never silently.
    """
    transports = [client._transport, *client._mounts.values()]
    for transport in transports:
        if transport is None:
            continue
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if pool is None or backend is None:
            raise RuntimeError(f"cannot enforce call deadlines on {type(transport).__name__}")
        if not isinstance(backend, DeadlineBackend):
            pool._network_backend = DeadlineBackend(backend)
    return client
