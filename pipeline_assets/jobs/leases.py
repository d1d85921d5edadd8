"""The leases a worker process holds, and the heartbeat that keeps them.

Each claim registers its jobs under its lease owner with a deadline: the latest
moment a healthy call could still be running. The heartbeat extends, in the
database, only leases whose deadline has not passed, so a stalled call stops
being extended and its jobs are rescued like a dead worker's.
"""

from __future__ import annotations

import logging
import threading
import time

from typing import Protocol, Sequence

log = logging.getLogger(__name__)


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
    """What the heartbeat needs of the database (``jobs.job_store.JobStore``)."""

    def extend_leases(self, held: Sequence[tuple[str, list[int]]], lease_seconds: float) -> None: ...


def heartbeat(leases: HeldLeases, store: LeaseStore, lease_seconds: float, stop: threading.Event) -> None:
    """Extend live leases every third of a lease until ``stop``."""
    interval = max(0.2, lease_seconds / 3)
    while not stop.wait(interval):
        live = leases.live()
        if not live:
            continue
        try:
            store.extend_leases(live, lease_seconds)
        except Exception:  # a missed beat is harmless; the next one retries
            log.exception("heartbeat failed")
