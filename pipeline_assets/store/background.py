"""Work on a connection of its own, in a thread a caller can stop at once (a worker's drain:
the vector index build, the text-search fill, beside its main loop)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Self

import psycopg

# How long ``cancel`` waits for the work to stop, and how often it cancels the running statement again.
CANCEL_SECONDS = 5.0
CANCEL_AGAIN_SECONDS = 0.25


def cancel_until_done(
    thread: threading.Thread, cancel: Callable[[float], object], timeout: float, again: float = CANCEL_AGAIN_SECONDS
) -> None:
    """Call ``cancel(seconds left)`` every ``again`` seconds while ``thread`` lives, for at most
    ``timeout`` seconds: a statement that began just after one cancel request is ended by the next."""
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        with contextlib.suppress(Exception):
            cancel(left)
        thread.join(min(again, max(0.0, deadline - time.monotonic())))


class BackgroundWork:
    """Runs ``work(conn)`` once in a daemon thread on a connection from ``connect``.

    ``cancel`` stops it: ``stopped`` is set for ``work`` to check between statements and the
    statement running is cancelled (its transaction rolls back). An exception of ``work``
    goes to ``failed``. ``done`` once over, whatever the outcome; ``on_done`` is told then.
    """

    def __init__(
        self, connect: Callable[[], psycopg.Connection], *, name: str, on_done: Callable[[], object] | None = None
    ) -> None:
        self._connect = connect
        self._on_done = on_done
        self.stopped = threading.Event()
        self.finished_at: float | None = None  # monotonic, once over
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def cancel(self, timeout: float = CANCEL_SECONDS) -> None:
        """Stop the work within ``timeout`` seconds: ``stopped`` is set and the running
        statement cancelled, again every ``CANCEL_AGAIN_SECONDS`` while the thread lives (a
        statement that began just after a cancel is cancelled by the next one)."""
        self.stopped.set()
        cancel_until_done(self._thread, self._cancel_statement, timeout)

    def _cancel_statement(self, timeout: float) -> None:
        with self._lock:
            conn = None if self.done else self._conn
        if conn is not None:
            conn.cancel_safe(timeout=timeout)

    def work(self, conn: psycopg.Connection) -> None:
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            if self.stopped.is_set():
                return
            conn = self._connect()  # outside the lock: a slow connect never holds up ``cancel``
            with self._lock:
                self._conn = conn
            with contextlib.closing(conn):
                if not self.stopped.is_set():
                    self.work(conn)
        except Exception as exc:
            self.failed(exc)
        finally:
            self.finished_at = time.monotonic()
            if self._on_done is not None:
                self._on_done()
