"""The worker: claim a batch, call the provider outside any transaction, complete.

Threads (``concurrency``) each loop claim -> call -> complete, taking a pooled
connection only for the short database steps, so a slow provider call holds no
connection, no transaction and no row lock. A heartbeat thread extends the
leases of healthy calls; the per-call timeout bounds a stalled one. The main
thread rescues expired leases of dead workers and decides when to stop.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import psycopg
from psycopg_pool import PoolTimeout

from pipeline_assets.jobs import backoff
from pipeline_assets.jobs import crashpoints
from pipeline_assets.store import db
from pipeline_assets.jobs import leases
from pipeline_assets.jobs import ledger
from pipeline_assets.jobs import models
from pipeline_assets.jobs import transitions
from pipeline_assets import settings
from pipeline_assets.jobs.budget import TokenBudget
from pipeline_assets.jobs.leases import HeldLeases
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, Provider, ProviderError, sanitize
from pipeline_assets.jobs.transitions import ClaimedJob

log = logging.getLogger(__name__)

# How long a stopping worker waits for in-flight calls before releasing their jobs.
SHUTDOWN_GRACE_SECONDS = 3.0

# Completion transactions retried on a deadlock with a concurrent ingest.
COMPLETE_RETRIES = 3

# The trivial input that tells a bad configuration from a bad input after a 400.
CONFIG_PROBE_TEXT = "ping"


@dataclass
class WorkerConfig:
    concurrency: int = settings.DEFAULT_CONCURRENCY
    lease_seconds: float = settings.DEFAULT_LEASE_SECONDS
    worker_id: str | None = None
    until_idle: bool = False
    batch_inputs: int | None = None  # default: the provider's max_batch_inputs
    poll_seconds: float = settings.IDLE_POLL_SECONDS
    rescue_interval: float = settings.RESCUE_INTERVAL_SECONDS
    build_index: bool = True  # build the model's HNSW index when the queue drains


@dataclass
class WorkerReport:
    embedded: int = 0
    superseded: int = 0
    failed: int = 0
    retried: int = 0
    throttled: int = 0
    refused: int = 0
    provider_calls: int = 0
    tokens: int = 0
    rescued: int = 0
    fatal: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for key, value in counts.items():
                setattr(self, key, getattr(self, key) + value)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class FatalProviderError(RuntimeError):
    """Configuration/auth failure: the worker stopped; no item was touched."""


class BudgetExhausted(RuntimeError):
    """A token budget was reached: the worker stopped claiming; jobs stay pending."""


class Worker:
    def __init__(self, url: str, provider: Provider, config: WorkerConfig,
                 stop_event: threading.Event | None = None) -> None:
        self.provider = provider
        self.config = config
        self.model_id = provider.spec.model_id
        self.worker_id = config.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        # Lease owners are unique per claim, so a late completion of an older
        # claim by the same worker id can never pass as the current lease.
        self._owner_prefix = f"{self.worker_id}/{secrets.token_hex(3)}"
        self._claim_seq = itertools.count(1)
        self.stop = stop_event or threading.Event()
        self.report = WorkerReport()
        self._pool = db.make_pool(url, min_size=1, max_size=config.concurrency + 2)
        self._leases = HeldLeases()
        self._idle = [False] * config.concurrency
        self._batch = min(config.batch_inputs or provider.spec.max_batch_inputs, provider.spec.max_batch_inputs)
        self._dimension: int | None = provider.spec.dimension  # recorded one wins, read in run()
        self._fatal: ProviderError | None = None
        self._had_failure = False  # reset the shared failure count only after failures
        self._indexed = False
        self._budget: str | None = None  # why claiming stopped on a budget
        self._config_checked: bool | None = None  # None: not probed yet
        self._paused_until = 0.0  # monotonic; a 429 seen here: send nothing more of held claims
        self._token_budget = TokenBudget.from_env(self.model_id)

    # -- lifecycle -------------------------------------------------------
    def run(self) -> WorkerReport:
        with self._pool.connection() as conn:
            models.ensure_model(conn, self.provider.spec)
            self._dimension = models.model_dimension(conn, self.model_id)
        self._refresh_spend()  # before any claim: today's spend by other workers
        threads = [threading.Thread(target=self._loop, args=(i,), name=f"embed-{i}", daemon=True)
                   for i in range(self.config.concurrency)]
        heartbeat = threading.Thread(target=leases.heartbeat, name="heartbeat", daemon=True,
                                     args=(self._leases, self._pool, self.config.lease_seconds, self.stop))
        for t in threads:
            t.start()
        heartbeat.start()
        next_rescue = 0.0
        try:
            while not self.stop.is_set():
                try:
                    now = time.monotonic()
                    if now >= next_rescue:
                        self._rescue()
                        next_rescue = now + self.config.rescue_interval
                    self._refresh_spend()
                    if self._budget is not None:
                        break
                    if all(self._idle) and self._nothing_outstanding():
                        self._on_drained()
                        if self.config.until_idle:
                            break
                except (psycopg.OperationalError, PoolTimeout) as exc:
                    # The database restarted or is unreachable for a moment:
                    # keep the worker, try again on the next beat.
                    log.warning("database unavailable in the worker's main loop: %s", exc)
                self.stop.wait(self.config.poll_seconds)
        finally:
            self.stop.set()
            deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            self._release_all()
            self._pool.close()
        if self._fatal is not None:
            self.report.fatal = self._fatal.message
            raise FatalProviderError(f"{self._fatal.error_class}: {self._fatal.message}")
        if self._budget is not None:
            raise BudgetExhausted(self._budget)
        return self.report

    def _refresh_spend(self) -> None:
        if self._token_budget.daily:
            with self._pool.connection() as conn:
                self._token_budget.refresh(conn, self.report.tokens)

    def _on_drained(self) -> None:
        """The queue is empty: build the model's vector index now if it is missing.

        Building HNSW over a drained backfill in bulk is far cheaper than
        maintaining it insert by insert during the backfill; after that,
        incremental inserts maintain it.
        """
        if self._indexed or not self.config.build_index:
            return
        if self._dimension:
            with self._pool.connection() as conn:
                models.ensure_index(conn, self.model_id, self._dimension)
            self._indexed = True

    def _nothing_outstanding(self) -> bool:
        with self._pool.connection() as conn:
            waiting, held = transitions.outstanding(conn, self.model_id)
        return not waiting and not held

    def _rescue(self) -> None:
        with self._pool.connection() as conn:
            counts = transitions.rescue_expired(conn)
        self.report.add(rescued=sum(counts.values()))

    def _release_all(self) -> None:
        held = self._leases.take_all()
        if not held:
            return
        with self._pool.connection() as conn:
            for owner, ids in held:
                transitions.give_back(conn, owner=owner, job_ids=ids)

    # -- one thread --------------------------------------------------------
    def _loop(self, index: int) -> None:
        while not self.stop.is_set():
            reason = self._token_budget.exceeded(self.report.tokens)
            if reason is not None:
                self._budget = reason
                self.stop.set()
                break
            owner = f"{self._owner_prefix}/{next(self._claim_seq)}"
            try:
                with self._pool.connection() as conn:
                    jobs = transitions.claim(conn, model_id=self.model_id, owner=owner, limit=self._batch,
                                       lease_seconds=self.config.lease_seconds)
            except Exception:
                log.exception("claim failed")
                self.stop.wait(self.config.poll_seconds)
                continue
            if not jobs:
                self._idle[index] = True
                self.stop.wait(self.config.poll_seconds)
                continue
            self._idle[index] = False
            requests = self._split(jobs)
            budget = settings.call_timeout() * (len(requests) + 1) + self.config.lease_seconds
            self._leases.hold(owner, [j.job_id for j in jobs], time.monotonic() + budget)
            try:
                crashpoints.reach(crashpoints.AFTER_CLAIM)
                gone = [j.job_id for j in jobs if j.text is None]
                if gone:
                    with self._pool.connection() as conn:
                        self.report.add(superseded=len(transitions.supersede_held(conn, owner=owner, job_ids=gone)))
                for n, request in enumerate(requests):
                    if self.stop.is_set() or self._provider_paused:
                        # Stopping, or the provider just throttled us: hand back
                        # what was not sent instead of hammering it.
                        rest = [j.job_id for r in requests[n:] for j in r]
                        with self._pool.connection() as conn:
                            transitions.give_back(conn, owner=owner, job_ids=rest)
                        break
                    self._call(owner, request)
            except Exception as exc:
                # A bug or a database hiccup, not the items' fault: count the
                # attempt and let the backoff retry them (rescue covers us if
                # even this fails).
                log.exception("batch failed in the worker")
                self._fail_held(owner, jobs, exc)
            finally:
                self._leases.drop(owner)

    def _config_ok(self) -> bool:
        """One trivial request (a single token) tells a bad input from a bad
        configuration; asked once per worker, after the first 400."""
        if self._config_checked is None:
            started = time.monotonic()
            try:
                result = self.provider.embed([CONFIG_PROBE_TEXT])
                self._config_checked, tokens, outcome, status = True, result.tokens, "config_probe", 200
            except ProviderError as err:
                self._config_checked = err.kind != TERMINAL
                tokens, outcome, status = 0, f"config_probe_{err.error_class}", err.status
            with self._pool.connection() as conn:
                ledger.record_call(conn, model_id=self.model_id, worker_id=self.worker_id, jobs=[],
                                   tokens=tokens, outcome=outcome, status=status,
                                   latency=time.monotonic() - started, billed=False)
            self.report.add(provider_calls=1)
        return self._config_checked

    @property
    def _provider_paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def _fail_held(self, owner: str, jobs: Sequence[ClaimedJob], exc: Exception) -> None:
        try:
            with self._pool.connection() as conn:
                transitions.fail_retryable(conn, owner=owner, job_ids=[j.job_id for j in jobs], delays=_delays(jobs),
                                     error_class="worker_error", message=sanitize(f"{type(exc).__name__}: {exc}"))
        except Exception:
            log.exception("could not hand back jobs; they return when their lease expires")

    def _split(self, jobs: Sequence[ClaimedJob]) -> list[list[ClaimedJob]]:
        """Group jobs into requests bounded by inputs and a token budget."""
        requests: list[list[ClaimedJob]] = []
        current: list[ClaimedJob] = []
        tokens = 0
        limit = self.provider.spec.max_batch_tokens
        for job in jobs:
            if job.text is None:
                continue
            if job.attempts > 1:
                # A job that failed before goes alone: if it is the poison, it
                # no longer drags innocent neighbours through its retries.
                requests.append([job])
                continue
            n = job.token_count or 0
            if current and (tokens + n > limit or len(current) >= self._batch):
                requests.append(current)
                current, tokens = [], 0
            current.append(job)
            tokens += n
        if current:
            requests.append(current)
        return requests

    def _call(self, owner: str, jobs: list[ClaimedJob]) -> None:
        started = time.monotonic()
        # A healthy call keeps its lease for as long as it may take.
        self._leases.extend_deadline(owner, started + settings.call_timeout() + self.config.lease_seconds)
        try:
            result = self.provider.embed([j.text for j in jobs])
        except ProviderError as err:
            latency = time.monotonic() - started
            with self._pool.connection() as conn:
                ledger.record_call(conn, model_id=self.model_id, worker_id=self.worker_id, jobs=jobs,
                                   tokens=0, outcome=err.error_class, status=err.status, latency=latency,
                                   billed=err.billed_maybe)
            self.report.add(provider_calls=1)
            self._handle_error(owner, jobs, err)
            return
        latency = time.monotonic() - started
        self.report.add(provider_calls=1, tokens=result.tokens)
        crashpoints.reach(crashpoints.AFTER_CALL)
        with self._pool.connection() as conn:
            expected = self._dimension
            got = {len(v) for v in result.vectors}
            if expected is not None and got != {expected}:
                # A misconfigured endpoint, not bad items: stop, touch nothing.
                transitions.give_back(conn, owner=owner, job_ids=[j.job_id for j in jobs])
                self._fatal = ProviderError(FATAL, "dimension_mismatch",
                                            f"provider returned {sorted(got)}-dimensional vectors for "
                                            f"{self.model_id}, which has {expected} dimensions")
                self.stop.set()
                return
            if expected is None:
                models.record_dimension(conn, self.model_id, len(result.vectors[0]))
                self._dimension = models.model_dimension(conn, self.model_id)
            # One transaction, pipelined: the ledger row and the completion
            # travel together and commit together. A deadlock with a
            # concurrent ingest is retried: the vectors are already paid for.
            for attempt in range(COMPLETE_RETRIES):
                try:
                    with conn.pipeline(), conn.transaction():
                        ledger.record_call(conn, model_id=self.model_id, worker_id=self.worker_id, jobs=jobs,
                                           tokens=result.tokens, outcome="ok", status=200, latency=latency,
                                           billed=True)
                        ready, superseded = transitions.complete(conn, owner=owner,
                                                           job_ids=[j.job_id for j in jobs],
                                                           vectors=result.vectors)
                    break
                except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                    if attempt == COMPLETE_RETRIES - 1:
                        raise
            if self._had_failure or any(j.probe for j in jobs):
                transitions.provider_healthy(conn, self.model_id)
                self._had_failure = False
        refused = len(jobs) - len(ready) - len(superseded)
        self.report.add(embedded=len(ready), superseded=len(superseded), refused=refused)

    def _handle_error(self, owner: str, jobs: list[ClaimedJob], err: ProviderError) -> None:
        ids = [j.job_id for j in jobs]
        self._had_failure = True
        if err.kind == TERMINAL and not self._config_ok():
            # The "bad input" is the configuration (e.g. an option the model
            # rejects): a trivial input fails too. Do not dead-letter the corpus.
            err = ProviderError(FATAL, "config_rejected", err.message, err.status)
        if err.kind == TERMINAL and len(jobs) > 1:
            # Isolate the bad input: split and retry halves; innocent neighbours succeed.
            mid = len(jobs) // 2
            self._call(owner, jobs[:mid])
            if self.stop.is_set() or self._provider_paused:
                with self._pool.connection() as conn:
                    transitions.give_back(conn, owner=owner, job_ids=[j.job_id for j in jobs[mid:]])
                return
            self._call(owner, jobs[mid:])
            return
        with self._pool.connection() as conn:
            if err.kind == TERMINAL:
                n = len(transitions.fail_terminal(conn, owner=owner, job_ids=ids, error_class=err.error_class,
                                            message=err.message))
                self.report.add(failed=n)
            elif err.kind == THROTTLED:
                # The provider's state, not the items': trip the shared breaker
                # and hand the items back without consuming their attempt.
                transitions.provider_failure(conn, self.model_id, trip=True, floor=err.retry_after or 0.0,
                                       base=settings.backoff_base(), cap=settings.backoff_cap(),
                                       threshold=settings.BREAKER_THRESHOLD)
                transitions.give_back(conn, owner=owner, job_ids=ids, delay=err.retry_after or 0.0,
                                error_class=err.error_class, message=err.message)
                self._paused_until = time.monotonic() + max(err.retry_after or 0.0, self.config.poll_seconds)
                self.report.add(throttled=len(ids))
            elif err.kind == RETRYABLE:
                transitions.provider_failure(conn, self.model_id, trip=False, floor=err.retry_after or 0.0,
                                       base=settings.backoff_base(), cap=settings.backoff_cap(),
                                       threshold=settings.BREAKER_THRESHOLD)
                moved = transitions.fail_retryable(conn, owner=owner, job_ids=ids, delays=_delays(jobs, err.retry_after),
                                             error_class=err.error_class, message=err.message)
                self.report.add(retried=sum(1 for s in moved.values() if s == "retry"),
                                failed=sum(1 for s in moved.values() if s == "failed"))
            elif err.kind == FATAL:
                transitions.give_back(conn, owner=owner, job_ids=ids)
                self._fatal = err
                self.stop.set()


def _delays(jobs: Sequence[ClaimedJob], retry_after: float | None = None) -> list[float]:
    """Each job's next retry: full jitter over its attempts, never before Retry-After."""
    return [backoff.retry_delay(j.attempts, base=settings.backoff_base(), cap=settings.backoff_cap(),
                                retry_after=retry_after) for j in jobs]
