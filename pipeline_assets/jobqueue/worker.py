"""The worker: claim a batch, call the provider outside any transaction, complete.

Threads (``concurrency``) each loop claim -> call -> complete, taking a pooled
connection only for the short database steps (``JobStore``), so a slow provider
call holds no connection, no transaction and no row lock. A heartbeat thread
extends the leases of healthy calls; the per-call deadline bounds a stalled one.
A liveness thread keeps this worker's row in app.workers fresh. The main thread
rescues expired leases and the claims of dead workers, and decides when to stop.

What happens to a claim is ``jobqueue.executor``'s (pure decisions: ``jobqueue.decisions``); a
claim thread's loop is ``jobqueue.claim_loop``'s, the work at a drain ``jobqueue.drain_work``'s;
this module starts the threads, runs the main loop and stops them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime

import psycopg

from pipeline_assets.jobqueue import job_log, leases
from pipeline_assets.jobqueue.budget import TokenBudget
from pipeline_assets.jobqueue.claim_loop import ClaimLoop
from pipeline_assets.jobqueue.drain_work import DrainWork
from pipeline_assets.jobqueue.executor import Executor, Stopping
from pipeline_assets.jobqueue.faults import DatabaseWait, WorkerFault, database_unavailable
from pipeline_assets.jobqueue.job_store import JobStore
from pipeline_assets.jobqueue.pg_job_store import PostgresJobStore
from pipeline_assets.jobqueue.provider_checks import ProviderView
from pipeline_assets.jobqueue.report import ReportCounts, WorkerReport
from pipeline_assets.jobqueue.send_limit import SendLimit
from pipeline_assets.jobqueue.worker_config import WorkerConfig
from pipeline_assets.providers import Provider
from pipeline_assets.store import db

log = logging.getLogger(__name__)

# How long a stopping worker waits for in-flight calls before releasing their jobs.
SHUTDOWN_GRACE_SECONDS = 3.0


class FatalProviderError(RuntimeError):
    """Configuration/auth failure: the worker stopped; no item was touched."""


class BudgetExhausted(RuntimeError):
    """A token budget was reached: the worker stopped claiming; jobs stay pending."""


class Worker:
    def __init__(
        self,
        url: str,
        provider: Provider,
        config: WorkerConfig,
        *,
        stop_event: threading.Event | None = None,
        store: JobStore | None = None,
        stages_since: datetime | None = None,
    ) -> None:
        self.url = url
        self.provider = provider
        self.config = config
        self.model_id = provider.spec.model_id
        self.worker_id = config.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        # Lease owners (one per claim: ``ClaimLoop``) all start with this worker's prefix (a UUID
        # per Worker), its row in app.workers: when it stops beating, its claims are rescued.
        self._owner_prefix = f"{self.worker_id}/{uuid.uuid4()}/"
        self.stop_event = stop_event or threading.Event()
        self.report = WorkerReport()
        # The queue; None: run() opens a PostgresJobStore (with its pool) on ``url``. A store given
        # here (MemoryJobStore) runs without a database and without a liveness row (with
        # ``build_index`` off: the index build needs the database).
        self.store: JobStore | None = store
        self._own_store = store is None
        self._stopping = Stopping(self.stop_event)
        # Wakes the main loop before its poll when a thread finds the queue empty or the index
        # build ends, so `--until-idle` exits when the work is done, not up to a poll later.
        self._wake = threading.Event()
        self._batch = min(config.batch_inputs or provider.spec.max_batch_inputs, provider.spec.max_batch_inputs)
        # The text-search fill (from the first beat with work queued) and the index build (at a drain).
        # ``stages_since``: the run's start (database clock), for the embed stage rows written at the drain.
        self._drain = DrainWork(self._connect, self.model_id, config, on_done=self._wake.set, stages_since=stages_since)
        self._token_budget = TokenBudget(
            self.model_id, per_run=config.run_token_budget, daily=config.daily_token_budget
        )
        self._db_wait = DatabaseWait()  # replaced by run(), with its pool

    @property
    def stages_until(self) -> datetime | None:
        """The clock the embed stage rows written at the drain are complete up to (None: not written)."""
        stages = self._drain.stages
        return stages.until if stages is not None else None

    # -- lifecycle -------------------------------------------------------
    def _connect(self) -> psycopg.Connection:
        """A connection of its own (liveness, the index build), preparing as its config allows."""
        return db.connect(self.url, prepare=self.config.prepare)

    def run(self) -> WorkerReport:
        if self.store is None:
            self._run_on_postgres()
        else:
            self._run(self.store)
        stopping = self._stopping
        if stopping.fatal is not None:
            self.report.fatal = stopping.fatal.message
            raise FatalProviderError(f"{stopping.fatal.error_class}: {stopping.fatal.message}")
        if stopping.fault is not None:
            raise WorkerFault(stopping.fault)
        if stopping.budget is not None:
            raise BudgetExhausted(stopping.budget)
        return self.report

    def _run_on_postgres(self) -> None:
        pool = db.make_pool(self.url, min_size=1, max_size=self.config.concurrency + 2, prepare=self.config.prepare)
        # Connections that met an unavailable or read-only server are replaced (``DatabaseWait``).
        self._db_wait = DatabaseWait(on_unavailable=pool.drain)
        try:
            self.store = store = PostgresJobStore(
                pool,
                model_id=self.model_id,
                worker_id=self.worker_id,
                worker_run=self._owner_prefix,
                backoff_base=self.config.executor.backoff_base,
                backoff_cap=self.config.executor.backoff_cap,
                scope=self.config.scope,
                observers=job_log.observers(
                    pool, worker_id=self.worker_id, model_id=self.model_id, extra=[ReportCounts(self.report)]
                ),
            )
            self._run(store)
        finally:
            pool.close()

    def _run(self, store: JobStore) -> None:
        executor = Executor(
            self.provider,
            store,
            self.config.executor,
            poll_seconds=self.config.poll_seconds,
            lease_seconds=self.config.lease_seconds,
            report=self.report,
            stopping=self._stopping,
            view=ProviderView(store.register_model(self.provider.spec), limit=SendLimit(self.config.concurrency)),
            db_wait=self._db_wait,
        )
        executor.check_at_start()  # a provider stopped for unusable answers: one trivial input first
        self._refresh_spend(store)  # before any claim: today's spend by other workers
        liveness = (
            leases.Liveness(
                self._connect,
                owner_prefix=self._owner_prefix,
                worker_id=self.worker_id,
                model_id=self.model_id,
                dead_after=self.config.worker_dead_after,
            ).start()
            if self._own_store
            else None
        )
        claims = ClaimLoop(
            executor,
            store,
            self.config,
            stopping=self._stopping,
            wake=self._wake,
            db_wait=self._db_wait,
            budget=self._token_budget,
            report=self.report,
            owner_prefix=self._owner_prefix,
            batch=self._batch,
        )
        threads = [
            threading.Thread(target=claims.run, args=(i,), name=f"embed-{i}", daemon=True)
            for i in range(self.config.concurrency)
        ]
        heartbeat = threading.Thread(
            target=leases.heartbeat,
            name="heartbeat",
            daemon=True,
            args=(executor.leases, store, self.config.lease_seconds, self.stop_event),
        )
        for t in threads:
            t.start()
        heartbeat.start()
        next_rescue = 0.0
        try:
            while not self.stop_event.is_set():
                self._wake.clear()  # a wake-up during this beat's checks is kept for the wait below
                try:
                    now = time.monotonic()
                    if now >= next_rescue:
                        store.rescue(self._owner_prefix)
                        self._db_wait.ok()
                        next_rescue = now + self.config.rescue_interval
                    self._refresh_spend(store)
                    if self._stopping.budget is not None:
                        break
                    if all(claims.idle) and not store.outstanding():
                        if (
                            self._drain.drained(store.ingest_running, executor.view.dimension)
                            and self.config.until_idle
                        ):
                            break
                    else:
                        self._drain.busy()
                except Exception as exc:
                    # The database restarted, is unreachable or read-only for a
                    # while: keep the worker, try again on the next beat.
                    if not self._db_wait.failed(exc):
                        if not isinstance(exc, psycopg.OperationalError):
                            raise
                        log.warning("database fault in the worker's main loop: %s", exc)
                self._wake.wait(self.config.poll_seconds)  # a stop is seen within a poll
        finally:
            self.stop_event.set()
            if self._drain.index_build is not None:
                self._drain.index_build.cancel()  # an unfinished build is left INVALID; the next one replaces it
            if self._drain.text_fill is not None:
                self._drain.text_fill.cancel()  # what it left is computed by the next ingest or drain
            if self._drain.stages is not None:
                self._drain.stages.cancel()  # unfinished: the end of the run records the rows
            deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            held = executor.leases.take_all()
            handed_back = False
            try:
                if held:
                    store.give_back_all(held)
                handed_back = True
            except Exception as exc:
                if not database_unavailable(exc):
                    raise
                log.warning(
                    "stopping while the database is unavailable: the claims held are rescued once it is "
                    "back, without using an attempt (%s)",
                    exc,
                )
            finally:
                # Claims not handed back keep the row, which goes stale: they are rescued in seconds.
                if liveness is not None:
                    liveness.stop(leave=handed_back)

    def _refresh_spend(self, store: JobStore) -> None:
        if self._token_budget.daily:
            run_tokens = self.report.tokens
            # Others' tokens from the ledger (their unanswered sends at their estimate), ours as answered.
            self._token_budget.refresh(store.tokens_today_of_others() + run_tokens, run_tokens)
