"""Work on a connection of its own, in a thread a caller can stop at once (a worker's drain:
the vector index build, the text-search fill, beside its main loop)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Self

import psycopg


class BackgroundWork:
    """Runs ``work(conn)`` once in a daemon thread on a connection from ``connect``.

    ``cancel`` stops it: the statement running is cancelled (its transaction rolls back) and
    ``stopped`` is set for ``work`` to check between statements. An exception of ``work``
    goes to ``failed``. ``done`` once over, whatever the outcome; ``on_done`` is told then.
    """

    def __init__(self, connect: Callable[[], psycopg.Connection], *, name: str,
                 on_done: Callable[[], object] | None = None) -> None:
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

    def cancel(self, timeout: float = 5.0) -> None:
        with self._lock:
            self.stopped.set()
            if self._conn is not None and not self.done:
                with contextlib.suppress(Exception):
                    self._conn.cancel_safe(timeout=timeout)
        self._thread.join(timeout)

    def work(self, conn: psycopg.Connection) -> None:
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            with self._lock:
                if self.stopped.is_set():
                    return
                self._conn = self._connect()
            with contextlib.closing(self._conn) as conn:
                self.work(conn)
        except Exception as exc:
            self.failed(exc)
        finally:
            self.finished_at = time.monotonic()
            if self._on_done is not None:
                self._on_done()
