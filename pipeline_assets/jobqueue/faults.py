"""Faults of our own (database, infrastructure, bugs), as the worker counts them, and the
database's unavailability, which the worker waits out.

Our faults are not an item's nor the provider's: the jobs held go back without using an
attempt (``decisions.worker_error``); ``decisions.MAX_CONSECUTIVE_WORKER_FAULTS`` in a row,
across threads, stop the worker with a one-line ``WorkerFault``. An unavailable database
(unreachable, restarting, not accepting connections yet, read-only) is never counted nor
charged: threads pause and retry the same step with a backoff (``DatabaseWait``), logging one
line when the wait starts and one when it ends.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg_pool import PoolTimeout

from pipeline_assets.messages import one_line
from pipeline_assets.store.db import DatabaseUnavailable

log = logging.getLogger("pipeline_assets.jobqueue.worker")

# SQLSTATEs of a server going away or not accepting connections yet
# (admin_shutdown, crash_shutdown, cannot_connect_now); class 08 is connection loss.
UNAVAILABLE_STATES = ("57P01", "57P02", "57P03")
# The SQLSTATE of a write refused by a read-only server or session
# (read_only_sql_transaction: default_transaction_read_only, a hot standby).
READ_ONLY_STATE = "25006"

# The pause between two tries of a step while the database is unavailable:
# exponential from the base, capped, half of it jittered (threads that failed
# together do not retry together; the cap bounds the time to resume).
DATABASE_RETRY_BASE_SECONDS = 0.2
DATABASE_RETRY_CAP_SECONDS = 2.0

T = TypeVar("T")


class WorkerFault(RuntimeError):
    """Faults of our own kept coming: the worker stopped; the jobs it held were
    given back without using an attempt."""


def read_only(exc: BaseException) -> bool:
    """A write refused because the server or the session is read-only."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate == READ_ONLY_STATE


def database_unavailable(exc: BaseException) -> bool:
    """The database is unreachable, restarting or read-only (wait for it), as
    opposed to a reachable one refusing us (a privilege, a statement timeout, a
    deadlock, a bug)."""
    if isinstance(exc, (PoolTimeout, DatabaseUnavailable)) or read_only(exc):
        return True
    return isinstance(exc, psycopg.OperationalError) and (
        exc.sqlstate is None or exc.sqlstate.startswith("08") or exc.sqlstate in UNAVAILABLE_STATES
    )


def why_unavailable(exc: BaseException) -> str:
    """A few words on why the database is unavailable."""
    if read_only(exc):
        return "read-only"
    state = getattr(exc, "sqlstate", None)
    return {"57P01": "shutting down", "57P02": "crashed", "57P03": "not accepting connections yet"}.get(
        state or "", "unreachable"
    )


class FaultCounter:
    """Faults in a row, shared by a worker's threads; a completion resets it."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def count(self, exc: BaseException) -> tuple[int, bool]:
        """Count a fault (an unavailable database is not counted: it is waited
        for); returns (faults in a row, this one included; unavailable)."""
        unavailable = database_unavailable(exc)
        with self._lock:
            if unavailable:
                return self._n + 1, True
            self._n += 1
            return self._n, False

    def reset(self) -> None:
        self._n = 0


class DatabaseWait:
    """The database's unavailability as a worker's threads see it, shared by them.

    ``failed(exc)``: whether an error is the database's unavailability. An outage's first one logs
    ``database unavailable (...): the worker waits ...`` (a later one of another kind, e.g. read-only,
    says so once) and calls ``on_unavailable``, as every read-only error does: the worker drains its
    pool, so dead and read-only connections are replaced and a new one reaches the new primary where the
    URL names several hosts (``target_session_attrs=read-write``). ``ok()`` after a successful write ends
    the outage (``database available again after N s``). ``pause(stop)`` sleeps before the next try;
    ``ride_out(step, stop)`` runs a step until it succeeds, raises another error, or ``stop`` is set.
    """

    def __init__(
        self,
        on_unavailable: Callable[[], object] | None = None,
        *,
        base: float = DATABASE_RETRY_BASE_SECONDS,
        cap: float = DATABASE_RETRY_CAP_SECONDS,
    ) -> None:
        self._on_unavailable = on_unavailable
        self._base = base
        self._cap = cap
        self._since: float | None = None  # monotonic, the first failure of the outage
        self._tries = 0  # failures since then, every thread
        self._reasons: set[str] = set()  # the kinds of unavailability this outage logged
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the database's unavailability (then noted, not charged)."""
        if not database_unavailable(exc):
            return False
        reason = why_unavailable(exc)
        with self._lock:
            first = self._since is None
            if first:
                self._since, self._tries, self._reasons = time.monotonic(), 0, set()
            self._tries += 1
            new_reason = reason not in self._reasons
            self._reasons.add(reason)
        if first:
            log.warning(
                "database unavailable (%s): the worker waits and retries, charging no job; %s", reason, one_line(exc)
            )
        elif new_reason:
            log.warning("database still unavailable, now %s: the worker goes on waiting; %s", reason, one_line(exc))
        if (first or read_only(exc)) and self._on_unavailable is not None:
            try:
                self._on_unavailable()
            except Exception as err:
                log.debug("could not drain the pool: %s", err)
        return True

    def ok(self) -> None:
        """A write went through: the outage (if any) is over."""
        if self._since is None:
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning("database available again after %.1f s: the worker resumes", time.monotonic() - since)

    def pause(self, stop: threading.Event) -> None:
        """Wait before the next try (returns early when ``stop`` is set)."""
        bound = min(self._cap, self._base * 2 ** min(self._tries, 30))
        stop.wait(random.uniform(bound / 2, bound))

    def ride_out(
        self,
        step: Callable[[], T],
        stop: threading.Event,
        on_wait: Callable[[], object] | None = None,
        give_up_after: float | None = None,
    ) -> T:
        """``step()``, tried again while the database is unavailable (``on_wait`` before
        each pause); its error is raised when it is not unavailability, once ``stop`` is
        set, or after ``give_up_after`` seconds."""
        started = time.monotonic()
        while True:
            try:
                result = step()
            except Exception as exc:
                if (
                    not self.failed(exc)
                    or stop.is_set()
                    or (give_up_after is not None and time.monotonic() - started >= give_up_after)
                ):
                    raise
                if on_wait is not None:
                    on_wait()
                self.pause(stop)
                continue
            self.ok()
            return result
