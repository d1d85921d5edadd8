"""The leases a worker process holds, the heartbeat that keeps them, and the worker's liveness.

Each claim registers its jobs under its lease owner with a deadline (the latest moment a
healthy call could still run); the heartbeat extends only leases whose deadline has not
passed, so a stalled call's jobs are rescued like a dead worker's. Liveness is faster: each
worker refreshes its row in ``app.workers`` (``Liveness``) several times per ``dead_after`` on
its own connection; its lease owners start with the row's owner prefix, so when it stops
beating (SIGKILL, OOM, a lost host) others rescue its claims within seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import psycopg

from pipeline_assets.jobqueue.faults import database_unavailable
from pipeline_assets.store import queries

log = logging.getLogger(__name__)

WORKERS = queries.load("workers")

# Beats per liveness window: a worker is declared dead only after missing this many in a row.
BEATS_PER_WINDOW = 5

# How long the row of a dead worker is kept (for inspection) once it holds no claim.
DEAD_WORKER_KEEP_SECONDS = 3600.0


class HeldLeases:
    def __init__(self) -> None:
        self._held: dict[str, tuple[list[int], float]] = {}  # owner -> (job ids, monotonic deadline)
        self._lock = threading.Lock()

    def hold(self, owner: str, job_ids: list[int], deadline: float) -> None:
        with self._lock:
            self._held[owner] = (job_ids, deadline)

    def extend_deadline(self, owner: str, deadline: float) -> None:
        with self._lock:
            if owner in self._held:
                self._held[owner] = (self._held[owner][0], deadline)

    def drop(self, owner: str) -> None:
        with self._lock:
            self._held.pop(owner, None)

    def live(self) -> list[tuple[str, list[int]]]:
        now = time.monotonic()
        with self._lock:
            return [(o, ids) for o, (ids, deadline) in self._held.items() if deadline > now]

    def take_all(self) -> list[tuple[str, list[int]]]:
        with self._lock:
            held = [(o, ids) for o, (ids, _) in self._held.items()]
            self._held.clear()
        return held


class LeaseStore(Protocol):
    """What the heartbeat needs of the queue (``jobqueue.job_store.JobStore``)."""

    def extend_leases(self, held: Sequence[tuple[str, list[int]]], lease_seconds: float) -> None: ...


def heartbeat(leases: HeldLeases, store: LeaseStore, lease_seconds: float, stop_event: threading.Event) -> None:
    """Extend live leases every third of a lease until ``stop_event`` is set."""
    interval = max(0.2, lease_seconds / 3)
    while not stop_event.wait(interval):
        live = leases.live()
        if not live:
            continue
        try:
            store.extend_leases(live, lease_seconds)
        except Exception as exc:  # a missed beat is harmless; the next one retries
            if database_unavailable(exc):  # the worker's wait line says so once
                log.debug("heartbeat missed, the database is unavailable: %s", exc)
            else:
                log.exception("heartbeat failed")


class Liveness:
    """This worker's row in ``app.workers``, kept fresh by a thread on its own
    connection (never the pool's: a busy pool must not make a live worker look dead)."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection],
        *,
        owner_prefix: str,
        worker_id: str,
        model_id: str,
        dead_after: float,
    ) -> None:
        self._connect = connect
        self._params = {
            "prefix": owner_prefix,
            "worker": worker_id,
            "model": model_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "dead_after": dead_after,
        }
        self._interval = dead_after / BEATS_PER_WINDOW
        self._conn: psycopg.Connection | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Liveness:
        """Register (a failure here is the caller's: no claim before the first beat), then beat."""
        conn = self._beat()
        try:
            forget_dead_workers(conn)
        except psycopg.Error as exc:  # housekeeping only
            log.warning("could not forget dead workers: %s", exc)
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> psycopg.Connection:
        """One beat; returns the liveness connection it went through."""
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
        conn = self._conn
        try:
            conn.execute(WORKERS.beat, self._params)
        except psycopg.Error:
            conn.close()  # reconnect on the next beat
            raise
        return conn

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except Exception as exc:  # a missed beat is harmless unless the window passes
                log.log(
                    logging.DEBUG if database_unavailable(exc) else logging.WARNING, "liveness beat failed: %s", exc
                )

    def stop(self, *, leave: bool = True) -> None:
        """Stop beating; ``leave``: delete the row (the claims were handed back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self._interval + 5)
        try:
            if leave:
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                self._conn.execute(WORKERS.leave, {"prefix": self._params["prefix"]})
        except Exception as exc:  # the row then simply goes stale and is forgotten
            log.warning("could not deregister the worker: %s", exc)
        finally:
            if self._conn is not None:
                self._conn.close()


def forget_dead_workers(conn: psycopg.Connection) -> int:
    """Drop the rows of workers long dead that hold no claim."""
    return conn.execute(WORKERS.forget_dead, {"keep": DEAD_WORKER_KEEP_SECONDS}).rowcount
