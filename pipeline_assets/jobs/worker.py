"""The worker: claim a batch, call the provider outside any transaction, complete.

Threads (``concurrency``) each loop claim -> call -> complete, taking a pooled
connection only for the short database steps (``JobStore``), so a slow provider
call holds no connection, no transaction and no row lock. A heartbeat thread
extends the leases of healthy calls; the per-call deadline bounds a stalled one.
A liveness thread keeps this worker's row in app.workers fresh. The main thread
rescues expired leases and the claims of dead workers, and decides when to stop.

What happens to a claim is ``jobs.executor``'s (pure decisions: ``jobs.decisions``; a
suspect's claim runs alone: ``jobs.suspects``); this module runs the threads.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import uuid

import psycopg

from pipeline_assets.jobs import job_log, leases, running_ingests, suspects
from pipeline_assets.jobs.budget import TokenBudget
from pipeline_assets.jobs.executor import Executor, Stopping
from pipeline_assets.jobs.faults import DatabaseWait, WorkerFault, database_unavailable
from pipeline_assets.jobs.job_store import JobStore
from pipeline_assets.jobs.pg_job_store import PostgresJobStore
from pipeline_assets.jobs.provider_checks import ProviderView
from pipeline_assets.jobs.report import ReportCounts, WorkerReport
from pipeline_assets.jobs.send_limit import SendLimit
from pipeline_assets.jobs.suspects import SuspectGate
from pipeline_assets.jobs.worker_config import WorkerConfig
from pipeline_assets.providers import Provider
from pipeline_assets.registry import vector_index
from pipeline_assets.store import db, text_search

log = logging.getLogger(__name__)

# How long a stopping worker waits for in-flight calls before releasing their jobs.
SHUTDOWN_GRACE_SECONDS = 3.0

# How a claim thread waits before its next claim.
WAIT_FOR_DATABASE = "database"   # the database is unavailable: its backoff
WAIT_A_POLL = "poll"             # nothing to claim, or a fault: a poll


class FatalProviderError(RuntimeError):
    """Configuration/auth failure: the worker stopped; no item was touched."""


class BudgetExhausted(RuntimeError):
    """A token budget was reached: the worker stopped claiming; jobs stay pending."""


class Worker:
    def __init__(self, url: str, provider: Provider, config: WorkerConfig, *,
                 stop_event: threading.Event | None = None, store: JobStore | None = None) -> None:
        self.url = url
        self.provider = provider
        self.config = config
        self.model_id = provider.spec.model_id
        self.worker_id = config.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        # Lease owners are unique per claim, so a late completion of an older
        # claim by the same worker id can never pass as the current lease. They
        # all start with this worker's prefix (a UUID per Worker), its row in
        # app.workers: when it stops beating, its claims are rescued.
        self._owner_prefix = f"{self.worker_id}/{uuid.uuid4()}/"
        self._claim_seq = itertools.count(1)
        self.stop = stop_event or threading.Event()
        self.report = WorkerReport()
        # The queue; None: run() opens a PostgresJobStore (with its pool) on ``url``. A store given
        # here (MemoryJobStore) runs without a database and without a liveness row (with
        # ``build_index`` off: the index build needs the database).
        self.store: JobStore | None = store
        self._own_store = store is None
        self._stopping = Stopping(self.stop)
        self._idle = [False] * config.concurrency
        # Wakes the main loop before its poll when a thread finds the queue empty or the index
        # build ends, so `--until-idle` exits when the work is done, not up to a poll later.
        self._wake = threading.Event()
        self._batch = min(config.batch_inputs or provider.spec.max_batch_inputs, provider.spec.max_batch_inputs)
        self._index_build: vector_index.BackgroundBuild | None = None  # started when the queue drains
        self._text_fill: text_search.BackgroundFill | None = None  # beside it: chunks' text-search vectors
        self._drained_since: float | None = None  # the queue empty at every beat since (monotonic)
        self._deferred_for_ingest = False  # the build was put off while an ingest runs (logged once)
        self._token_budget = TokenBudget(self.model_id, per_run=config.run_token_budget,
                                         daily=config.daily_token_budget)
        self._db_wait = DatabaseWait()  # replaced by run(), with its pool
        self._suspects = SuspectGate()  # a job that may crash the worker runs alone in it

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
        pool = db.make_pool(self.url, min_size=1, max_size=self.config.concurrency + 2,
                            prepare=self.config.prepare)
        # Connections that met an unavailable or read-only server are replaced (``DatabaseWait``).
        self._db_wait = DatabaseWait(on_unavailable=pool.drain)
        try:
            self.store = store = PostgresJobStore(
                pool, model_id=self.model_id, worker_id=self.worker_id, run=self._owner_prefix,
                backoff_base=self.config.executor.backoff_base,
                backoff_cap=self.config.executor.backoff_cap,
                scope=self.config.scope, observers=job_log.observers(pool, worker_id=self.worker_id,
                                                                     model_id=self.model_id,
                                                                     extra=[ReportCounts(self.report)]))
            self._run(store)
        finally:
            pool.close()

    def _run(self, store: JobStore) -> None:
        executor = Executor(self.provider, store, self.config.executor, poll_seconds=self.config.poll_seconds,
                            lease_seconds=self.config.lease_seconds, report=self.report, stopping=self._stopping,
                            view=ProviderView(store.register_model(self.provider.spec),
                                              limit=SendLimit(self.config.concurrency)), db_wait=self._db_wait)
        executor.check_at_start()  # a provider stopped for unusable answers: one trivial input first
        self._refresh_spend(store)  # before any claim: today's spend by other workers
        liveness = leases.Liveness(self._connect, owner_prefix=self._owner_prefix,
                                   worker_id=self.worker_id, model_id=self.model_id,
                                   dead_after=self.config.worker_dead_after).start() if self._own_store else None
        threads = [threading.Thread(target=self._loop, args=(i, executor, store), name=f"embed-{i}", daemon=True)
                   for i in range(self.config.concurrency)]
        heartbeat = threading.Thread(target=leases.heartbeat, name="heartbeat", daemon=True,
                                     args=(executor.leases, store, self.config.lease_seconds, self.stop))
        for t in threads:
            t.start()
        heartbeat.start()
        next_rescue = 0.0
        try:
            while not self.stop.is_set():
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
                    if all(self._idle) and not store.outstanding():
                        if self._on_drained(store, executor.view.dimension) and self.config.until_idle:
                            break
                    else:
                        self._drained_since = None
                except Exception as exc:
                    # The database restarted, is unreachable or read-only for a
                    # while: keep the worker, try again on the next beat.
                    if not self._db_wait.failed(exc):
                        if not isinstance(exc, psycopg.OperationalError):
                            raise
                        log.warning("database fault in the worker's main loop: %s", exc)
                self._wake.wait(self.config.poll_seconds)  # a stop is seen within a poll
        finally:
            self.stop.set()
            if self._index_build is not None:
                self._index_build.cancel()  # an unfinished build is left INVALID; the next one replaces it
            if self._text_fill is not None:
                self._text_fill.cancel()    # what it left is computed by the next ingest or drain
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
                log.warning("stopping while the database is unavailable: the claims held are rescued once it is "
                            "back, without using an attempt (%s)", exc)
            finally:
                # Claims not handed back keep the row, which goes stale: they are rescued in seconds.
                if liveness is not None:
                    liveness.stop(leave=handed_back)

    def _refresh_spend(self, store: JobStore) -> None:
        if self._token_budget.daily:
            run_tokens = self.report.tokens
            # Others' tokens from the ledger (their unanswered sends at their estimate), ours as answered.
            self._token_budget.refresh(store.tokens_today_of_others() + run_tokens, run_tokens)

    def _on_drained(self, store: JobStore, dimension: int | None) -> bool:
        """The queue is empty: build the model's missing vector index (in bulk: far cheaper than
        per insert during a backfill) beside this loop, concurrently (``vector_index``), and
        compute the chunks' missing text-search vectors beside it (``text_search``); an
        error is a logged warning. Returns whether `--until-idle` may exit (the build is over,
        or put off: an ingest is running, which would insert into a fresh index row by row).

        When is ``running_ingests.index_build_decision``'s: no build while an ingest runs and,
        unless `--until-idle`, before the queue has stayed empty for ``index_quiet_seconds``."""
        if not self.config.build_index or not dimension:
            return True
        build, fill = self._index_build, self._text_fill
        if build is not None and not build.retry_due(time.monotonic()):
            return build.done and (fill is None or fill.done)
        now = time.monotonic()
        if self._drained_since is None:
            self._drained_since = now
        decision = running_ingests.index_build_decision(
            store.ingest_running, drained_for=now - self._drained_since,
            quiet_seconds=0.0 if self.config.until_idle else self.config.index_quiet_seconds)
        if decision == running_ingests.WAIT:
            return False
        if decision == running_ingests.PUT_OFF:
            if not self._deferred_for_ingest:
                log.info("%s", running_ingests.put_off_line(self.model_id))
                self._deferred_for_ingest = True
            return True
        self._index_build = build = vector_index.BackgroundBuild(
            self._connect, self.model_id, dimension, on_done=self._wake.set,
            memory_cap=self.config.index_build_memory, session=self.config.prepare).start()
        if fill is None:  # chunks an ingest left without their text-search vectors, on another connection
            self._text_fill = fill = text_search.BackgroundFill(self._connect, on_done=self._wake.set).start()
        return build.done and fill.done

    # -- one thread --------------------------------------------------------
    def _loop(self, index: int, executor: Executor, store: JobStore) -> None:
        try:
            self._claim_loop(index, executor, store)
        finally:
            self._wake.set()  # stopping (a signal, a fatal error, a budget): the main loop sees it at once

    def _claim_loop(self, index: int, executor: Executor, store: JobStore) -> None:
        while not self.stop.is_set():
            reason = self._token_budget.exceeded(self.report.tokens)
            if reason is not None:
                self._stopping.stop(budget=reason)
                break
            # A slot of the worker's send limit (fewer requests in flight while the provider fails);
            # waiting for one, the thread holds nothing: idle for `--until-idle`.
            self._idle[index] = True
            if not executor.view.limit.acquire(self.stop, self.config.poll_seconds):
                break
            self._suspects.enter(self.stop)
            try:
                wait = self._claim_once(index, executor, store)
            finally:
                self._suspects.leave()
                executor.view.limit.release()
            if wait == WAIT_FOR_DATABASE:
                self._db_wait.pause(self.stop)
            elif wait == WAIT_A_POLL:
                self.stop.wait(self.config.poll_seconds)

    def _claim_once(self, index: int, executor: Executor, store: JobStore) -> str | None:
        """Claim a batch and run it; returns how to wait before the next claim (None: not at all)."""
        owner = f"{self._owner_prefix}{next(self._claim_seq)}"
        try:
            jobs = store.claim(owner=owner, limit=self._batch, lease_seconds=self.config.lease_seconds)
        except Exception as exc:
            if self._db_wait.failed(exc):  # nothing held, nothing counted: wait and claim again
                return WAIT_FOR_DATABASE
            log.warning("claim failed: %s", exc)
            executor.release(owner, [], exc)  # nothing held; counts towards stopping
            return WAIT_A_POLL
        self._db_wait.ok()
        self._idle[index] = not jobs
        if not jobs:
            self._wake.set()  # the main loop looks whether the whole queue drained
            return WAIT_A_POLL
        if suspects.run_claim(executor, self._suspects, owner, jobs, self._batch):
            return None
        return WAIT_A_POLL  # its suspect went back untouched: another suspect of this process runs alone
