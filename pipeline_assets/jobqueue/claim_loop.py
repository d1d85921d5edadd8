"""A worker's claim threads: each loops claim -> run (``Executor``, a suspect's claim alone:
``jobqueue.suspects``) until the worker stops or a token budget is reached. A thread claims while
holding a slot of the send limit and the suspect gate; between claims it waits out an
unavailable database or a poll. ``idle`` says which threads hold nothing (for `--until-idle`).
"""

from __future__ import annotations

import itertools
import logging
import threading

from pipeline_assets.jobqueue import suspects
from pipeline_assets.jobqueue.budget import TokenBudget
from pipeline_assets.jobqueue.executor import Executor, Stopping
from pipeline_assets.jobqueue.faults import DatabaseWait
from pipeline_assets.jobqueue.job_store import JobStore
from pipeline_assets.jobqueue.report import WorkerReport
from pipeline_assets.jobqueue.suspects import SuspectGate
from pipeline_assets.jobqueue.worker_config import WorkerConfig

log = logging.getLogger("pipeline_assets.jobqueue.worker")  # the worker's log

# How a claim thread waits before its next claim.
WAIT_FOR_DATABASE = "database"  # the database is unavailable: its backoff
WAIT_A_POLL = "poll"  # nothing to claim, or a fault: a poll


class ClaimLoop:
    """The loop of each claim thread (``run(index)``), over one executor and store."""

    def __init__(
        self,
        executor: Executor,
        store: JobStore,
        config: WorkerConfig,
        *,
        stopping: Stopping,
        wake: threading.Event,
        db_wait: DatabaseWait,
        budget: TokenBudget,
        report: WorkerReport,
        owner_prefix: str,
        batch: int,
    ) -> None:
        self.executor = executor
        self.store = store
        self.config = config
        self.stop_event = stopping.event
        self._stopping = stopping
        self._wake = wake
        self._db_wait = db_wait
        self._token_budget = budget
        self.report = report
        # Lease owners are unique per claim, so a late completion of an older claim by the same
        # worker can never pass as the current lease.
        self._owner_prefix = owner_prefix
        self._claim_seq = itertools.count(1)
        self._batch = batch
        self.idle = [False] * config.concurrency
        self._suspects = SuspectGate()  # a job that may crash the worker runs alone in it

    def run(self, index: int) -> None:
        try:
            self._claim_loop(index)
        finally:
            self._wake.set()  # stopping (a signal, a fatal error, a budget): the main loop sees it at once

    def _claim_loop(self, index: int) -> None:
        executor = self.executor
        while not self.stop_event.is_set():
            reason = self._token_budget.exceeded(self.report.tokens)
            if reason is not None:
                self._stopping.stop(budget=reason)
                break
            # A slot of the worker's send limit (fewer requests in flight while the provider fails);
            # waiting for one, the thread holds nothing: idle for `--until-idle`.
            self.idle[index] = True
            if not executor.view.limit.acquire(self.stop_event, self.config.poll_seconds):
                break
            self._suspects.enter(self.stop_event)
            try:
                wait = self._claim_once(index)
            finally:
                self._suspects.leave()
                executor.view.limit.release()
            if wait == WAIT_FOR_DATABASE:
                self._db_wait.pause(self.stop_event)
            elif wait == WAIT_A_POLL:
                self.stop_event.wait(self.config.poll_seconds)

    def _claim_once(self, index: int) -> str | None:
        """Claim a batch and run it; returns how to wait before the next claim (None: not at all)."""
        owner = f"{self._owner_prefix}{next(self._claim_seq)}"
        try:
            jobs = self.store.claim(owner=owner, limit=self._batch, lease_seconds=self.config.lease_seconds)
        except Exception as exc:
            if self._db_wait.failed(exc):  # nothing held, nothing counted: wait and claim again
                return WAIT_FOR_DATABASE
            log.warning("claim failed: %s", exc)
            self.executor.release(owner, [], exc)  # nothing held; counts towards stopping
            return WAIT_A_POLL
        self._db_wait.ok()
        self.idle[index] = not jobs
        if not jobs:
            self._wake.set()  # the main loop looks whether the whole queue drained
            return WAIT_A_POLL
        if suspects.run_claim(self.executor, self._suspects, owner, jobs, self._batch):
            return None
        return WAIT_A_POLL  # its suspect went back untouched: another suspect of this process runs alone
