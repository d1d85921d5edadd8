"""Faults of our own (database, infrastructure, bugs), as the worker counts them.

Not an item's fault and not the provider's: the jobs held go back without using
an attempt (``decisions.worker_error``), and a worker that meets
``decisions.MAX_CONSECUTIVE_WORKER_FAULTS`` of them in a row, across its
threads, stops with a one-line ``WorkerFault``. A database that is merely
unreachable (a restart) is waited for instead.
"""

from __future__ import annotations

import threading

import psycopg
from psycopg_pool import PoolTimeout

# SQLSTATEs of a server going away or not accepting connections yet
# (admin_shutdown, crash_shutdown, cannot_connect_now); class 08 is connection loss.
UNAVAILABLE_STATES = ("57P01", "57P02", "57P03")


class WorkerFault(RuntimeError):
    """Faults of our own kept coming: the worker stopped; the jobs it held were
    given back without using an attempt."""


def database_unavailable(exc: BaseException) -> bool:
    """The database is unreachable or restarting (wait for it), as opposed to a
    reachable one refusing us (a privilege, a statement timeout, a deadlock)."""
    if isinstance(exc, PoolTimeout):
        return True
    return isinstance(exc, psycopg.OperationalError) and (
        exc.sqlstate is None or exc.sqlstate.startswith("08") or exc.sqlstate in UNAVAILABLE_STATES)


class FaultCounter:
    """Faults in a row, shared by a worker's threads; a completion resets it."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def count(self, exc: BaseException) -> tuple[int, bool]:
        """Count a fault (an unreachable database is not counted: it is waited
        for); returns (faults in a row, this one included; unavailable)."""
        unavailable = database_unavailable(exc)
        with self._lock:
            if unavailable:
                return self._n + 1, True
            self._n += 1
            return self._n, False

    def reset(self) -> None:
        self._n = 0
