"""A job that may crash its worker is worked alone in its worker process.

A job that has met ``request_plan.FREE_FAULTS`` faults is a suspect: its claim holds it alone
(``decisions.alone_if_suspect``, in ``run_claim``) and ``SuspectGate`` runs that claim only while no other claim
of the process is held, so if the process dies the rescue finds the suspect the only job of a
dead process and charges it (``rescue_expired``), never an innocent neighbour. A process holds
one suspect at a time: a second suspect's claim is handed back untouched instead of waiting
under its lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from pipeline_assets.jobqueue import decisions
from pipeline_assets.jobqueue.changes import ClaimedJob
from pipeline_assets.jobqueue.executor import Executor

# How often a waiting thread looks at its stop event.
STOP_CHECK_SECONDS = 0.5


class SuspectGate:
    """Claims of a worker's threads run side by side (``enter``/``leave``); a suspect's
    claim runs alone (``alone``, by a thread that entered): new claims wait while one waits
    or runs, it starts once the claims already held are over, and another suspect's claim
    meanwhile is turned away. A stop lets everyone through (what runs then hands its jobs back)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = 0  # claims running side by side
        self._alone = False  # a suspect's claim is running
        self._waiting = 0  # suspects' claims waiting to run alone

    def enter(self, stop_event: threading.Event) -> None:
        with self._cond:
            while (self._alone or self._waiting) and not stop_event.is_set():
                self._cond.wait(STOP_CHECK_SECONDS)
            self._held += 1

    def leave(self) -> None:
        with self._cond:
            self._held -= 1
            self._cond.notify_all()

    @contextmanager
    def alone(self, stop_event: threading.Event) -> Iterator[bool]:
        """Run the body as the only claim of this process (the caller entered): yields True
        once it is, or False at once while another suspect's claim waits or runs alone (the
        caller hands its suspect back: the process holds one suspect at a time)."""
        with self._cond:
            if self._waiting or self._alone:
                turned_away = True
            else:
                turned_away = False
                self._held -= 1
                self._waiting += 1
                while (self._held or self._alone) and not stop_event.is_set():
                    self._cond.wait(STOP_CHECK_SECONDS)
                self._waiting -= 1
                self._alone = True
        if turned_away:
            yield False
            return
        try:
            yield True
        finally:
            with self._cond:
                self._alone = False
                self._held += 1
                self._cond.notify_all()


def run_claim(executor: Executor, gate: SuspectGate, owner: str, jobs: Sequence[ClaimedJob], batch: int) -> bool:
    """Run a claim (``Executor.run_claim``), a suspect alone: the claim's other jobs go back
    untouched, and the suspect's claim runs as the only one of this process (``gate``, which the
    calling thread entered). Returns False when the suspect went back untouched instead, because
    another suspect of this process waits or runs alone (were it held, a crash of the other's run
    would find two jobs of the dead process)."""
    # Random provider faults make no suspect; before any answer (a worker restarted after
    # crashes) every fault counts, and so does every fault of a job a crash failed last
    # (decisions.suspect), as the rescue counts them.
    rates = executor.view.rates
    threshold = rates.fault_threshold() if rates.observed() else 1
    jobs, others = decisions.alone_if_suspect(jobs, threshold)
    if others:
        executor.release_now(owner, others)
    if not decisions.suspect(jobs[0], threshold):
        executor.run_claim(owner, jobs, batch)
        return True
    # Its lease is kept while the other claims of this process end.
    executor.leases.hold(
        owner, [jobs[0].job_id], time.monotonic() + executor.config.call_timeout + executor.lease_seconds
    )
    with gate.alone(executor.stopping.event) as turn:
        if turn:
            executor.run_claim(owner, jobs, batch)
            return True
    executor.leases.drop(owner)
    executor.release_now(owner, jobs)
    return False
