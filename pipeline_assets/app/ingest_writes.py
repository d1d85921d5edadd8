"""One ingest's database statements in a thread of their own, so reading and extraction go on
while a batch is written.

Every statement of an ingest runs on its one connection, in this thread alone, one at a time,
until ``finish`` returns. Transactions run in the order queued; a lookup runs before the
transactions still waiting (never during one): it reads documents of batches not handed out
yet, which no queued transaction writes. At most ``writes_ahead`` transactions wait or run.
A statement that raises stops the rest: its error is raised in the caller by the next
``result``, ``write`` or ``finish``. Leaving the ``with`` block on the caller's error waits for
the transactions queued (they commit); on an interrupt (KeyboardInterrupt, SystemExit, a run's
cancellation) only for the statement running now, which ``cancel`` (if given) ends.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

from pipeline_assets.store.background import cancel_until_done

T = TypeVar("T")

# Batch transactions waiting or running at most: one written while the next is collected and
# queued keeps the database busy without holding more than a few batches' documents.
WRITES_AHEAD = 2

# An interrupted ingest cancels the statement running while the thread lives
# (``store.background.cancel_until_done``), for at most CANCEL_FOR_SECONDS, then waits for it to end.
CANCEL_FOR_SECONDS = 30.0

_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class _Skipped(Exception):
    """A statement not run because an earlier one raised."""


class DatabaseThread:
    """Runs one ingest's statements in a thread of its own (see the module docstring)."""

    def __init__(self, *, writes_ahead: int = WRITES_AHEAD, cancel: Callable[[], None] | None = None) -> None:
        self._lookups: deque[_Call] = deque()
        self._writes: deque[_Call] = deque()
        self._queued: deque[tuple[Future[Any], Callable[[Any], None]]] = deque()  # writes not harvested
        self._writes_ahead = max(1, writes_ahead)
        self._error: BaseException | None = None
        self._closing = False
        self._dropping = False
        self._cancel = cancel  # ends the statement running now (an interrupt does not wait for it)
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="ingest-db", daemon=True)
        self._thread.start()

    def __enter__(self) -> DatabaseThread:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        with self._wake:
            self._closing = True
            # An error of the caller's: the transactions queued still commit (what was done is
            # kept, as a batch written before the error would be); an interrupt: they are skipped.
            self._dropping = kind is not None and not issubclass(kind, Exception)
            self._wake.notify()
        if self._dropping and self._cancel is not None:
            # Again while the thread lives: a statement that began just after a cancel request
            # (the next of the same transaction, a lock wait) is ended by the next one.
            cancel = self._cancel
            cancel_until_done(self._thread, lambda _left: cancel(), CANCEL_FOR_SECONDS)
        self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._lookups or self._writes or self._closing):
                    self._wake.wait()
                if self._closing and (self._dropping or not (self._lookups or self._writes)):
                    for future, _, _ in (*self._lookups, *self._writes):
                        future.set_exception(_Skipped())
                    return
                future, fn, args = (self._lookups or self._writes).popleft()
            if self._error is not None:
                future.set_exception(_Skipped())
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # the caller's to raise: noted here, raised there
                self._error = exc
                future.set_exception(exc)

    def _queue(self, queue: deque[_Call], fn: Callable[..., T], args: tuple[Any, ...]) -> Future[T]:
        future: Future[T] = Future()
        with self._wake:
            queue.append((future, fn, args))
            self._wake.notify()
        return future

    def lookup(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue a read ``fn(*args)`` ahead of the transactions waiting; read it with ``result``."""
        return self._queue(self._lookups, fn, args)

    def result(self, future: Future[T]) -> T:
        """The value of a queued statement, or the error of the first statement that raised."""
        try:
            return future.result()
        except _Skipped:
            assert self._error is not None
            raise self._error from None

    def write(self, done: Callable[[T], None], fn: Callable[..., T], *args: Any) -> None:
        """Queue a batch transaction ``fn(*args)``; ``done(value)`` is called in the caller's
        thread once it has committed (by a later ``write`` or by ``finish``, in the order queued)."""
        self._queued.append((self._queue(self._writes, fn, args), done))
        while len(self._queued) > self._writes_ahead:
            self._harvest()

    def _harvest(self) -> None:
        future, done = self._queued.popleft()
        done(self.result(future))

    def finish(self) -> None:
        """Wait for every transaction queued (their ``done`` called); the first error raised."""
        while self._queued:
            self._harvest()
