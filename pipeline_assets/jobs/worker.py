"""The worker: claim a batch, call the provider outside any transaction, complete.

Threads (``concurrency``) each loop claim -> call -> complete, taking a pooled
connection only for the short database steps (``JobStore``), so a slow provider
call holds no connection, no transaction and no row lock. A heartbeat thread
extends the leases of healthy calls; the per-call timeout bounds a stalled one.
The main thread rescues expired leases of dead workers and decides when to stop.

What to do after an answer or an error is decided by the pure functions of
``jobs.decisions``; this module only carries the outcomes out.
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

from pipeline_assets.jobs import crashpoints, decisions, leases
from pipeline_assets.jobs.budget import TokenBudget
from pipeline_assets.jobs.decisions import Fail, GiveBack, ProbeConfig, Retry, Split, Stop
from pipeline_assets.jobs.job_store import JobStore
from pipeline_assets.jobs.leases import HeldLeases
from pipeline_assets.jobs.transitions import ClaimedJob
from pipeline_assets.providers import TERMINAL, Provider, ProviderError
from pipeline_assets.settings import (DEFAULT_CONCURRENCY, DEFAULT_LEASE_SECONDS, IDLE_POLL_SECONDS,
                                      RESCUE_INTERVAL_SECONDS, Settings)
from pipeline_assets.store import db

log = logging.getLogger(__name__)

# How long a stopping worker waits for in-flight calls before releasing their jobs.
SHUTDOWN_GRACE_SECONDS = 3.0

# The trivial input that tells a bad configuration from a bad input after a 400.
CONFIG_PROBE_TEXT = "ping"


@dataclass
class WorkerConfig:
    concurrency: int = DEFAULT_CONCURRENCY
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    worker_id: str | None = None
    until_idle: bool = False
    batch_inputs: int | None = None  # default: the provider's max_batch_inputs
    poll_seconds: float = IDLE_POLL_SECONDS
    rescue_interval: float = RESCUE_INTERVAL_SECONDS
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
    def __init__(self, url: str, provider: Provider, config: WorkerConfig, *, settings: Settings,
                 stop_event: threading.Event | None = None) -> None:
        self.url = url
        self.provider = provider
        self.config = config
        self.settings = settings
        self.model_id = provider.spec.model_id
        self.worker_id = config.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        # Lease owners are unique per claim, so a late completion of an older
        # claim by the same worker id can never pass as the current lease.
        self._owner_prefix = f"{self.worker_id}/{secrets.token_hex(3)}"
        self._claim_seq = itertools.count(1)
        self.stop = stop_event or threading.Event()
        self.report = WorkerReport()
        self.store: JobStore | None = None  # opened (with its pool) by run()
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
        self._token_budget = TokenBudget.from_settings(self.model_id, settings)

    # -- lifecycle -------------------------------------------------------
    def run(self) -> WorkerReport:
        pool = db.make_pool(self.url, min_size=1, max_size=self.config.concurrency + 2)
        try:
            self.store = JobStore(pool, model_id=self.model_id, worker_id=self.worker_id,
                                  backoff_base=self.settings.backoff_base, backoff_cap=self.settings.backoff_cap)
            self._run()
        finally:
            pool.close()
        if self._fatal is not None:
            self.report.fatal = self._fatal.message
            raise FatalProviderError(f"{self._fatal.error_class}: {self._fatal.message}")
        if self._budget is not None:
            raise BudgetExhausted(self._budget)
        return self.report

    def _run(self) -> None:
        self._dimension = self.store.register_model(self.provider.spec)
        self._refresh_spend()  # before any claim: today's spend by other workers
        threads = [threading.Thread(target=self._loop, args=(i,), name=f"embed-{i}", daemon=True)
                   for i in range(self.config.concurrency)]
        heartbeat = threading.Thread(target=leases.heartbeat, name="heartbeat", daemon=True,
                                     args=(self._leases, self.store, self.config.lease_seconds, self.stop))
        for t in threads:
            t.start()
        heartbeat.start()
        next_rescue = 0.0
        try:
            while not self.stop.is_set():
                try:
                    now = time.monotonic()
                    if now >= next_rescue:
                        self.report.add(rescued=self.store.rescue())
                        next_rescue = now + self.config.rescue_interval
                    self._refresh_spend()
                    if self._budget is not None:
                        break
                    if all(self._idle) and not self.store.outstanding():
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
            held = self._leases.take_all()
            if held:
                self.store.give_back_all(held)

    def _refresh_spend(self) -> None:
        if self._token_budget.daily:
            run_tokens = self.report.tokens
            self._token_budget.refresh(self.store.tokens_today(), run_tokens)

    def _on_drained(self) -> None:
        """The queue is empty: build the model's vector index now if it is missing.

        Building HNSW over a drained backfill in bulk is far cheaper than
        maintaining it insert by insert during the backfill; after that,
        incremental inserts maintain it.
        """
        if self._indexed or not self.config.build_index:
            return
        if self._dimension:
            self.store.ensure_index(self._dimension)
            self._indexed = True

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
                jobs = self.store.claim(owner=owner, limit=self._batch, lease_seconds=self.config.lease_seconds)
            except Exception:
                log.exception("claim failed")
                self.stop.wait(self.config.poll_seconds)
                continue
            if not jobs:
                self._idle[index] = True
                self.stop.wait(self.config.poll_seconds)
                continue
            self._idle[index] = False
            requests = decisions.plan_requests(jobs, max_inputs=self._batch,
                                               max_tokens=self.provider.spec.max_batch_tokens)
            budget = self.settings.call_timeout * (len(requests) + 1) + self.config.lease_seconds
            self._leases.hold(owner, [j.job_id for j in jobs], time.monotonic() + budget)
            try:
                crashpoints.reach(crashpoints.AFTER_CLAIM, self.settings.crashpoint)
                gone = decisions.unwanted(jobs)
                if gone:
                    self.report.add(superseded=len(self.store.supersede(owner=owner, job_ids=gone)))
                for n, request in enumerate(requests):
                    if self.stop.is_set() or self._provider_paused:
                        # Stopping, or the provider just throttled us: hand back
                        # what was not sent instead of hammering it.
                        self.store.give_back(owner=owner, job_ids=[j.job_id for r in requests[n:] for j in r])
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

    @property
    def _provider_paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def _fail_held(self, owner: str, jobs: Sequence[ClaimedJob], exc: Exception) -> None:
        retry = decisions.worker_error(exc, jobs, base=self.settings.backoff_base, cap=self.settings.backoff_cap)
        try:
            self.store.fail_retryable(owner=owner, job_ids=retry.job_ids, delays=retry.delays,
                                      error_class=retry.error_class, message=retry.message)
        except Exception:
            log.exception("could not hand back jobs; they return when their lease expires")

    def _call(self, owner: str, jobs: Sequence[ClaimedJob]) -> None:
        started = time.monotonic()
        # A healthy call keeps its lease for as long as it may take.
        self._leases.extend_deadline(owner, started + self.settings.call_timeout + self.config.lease_seconds)
        try:
            result = self.provider.embed([j.text for j in jobs])
        except ProviderError as err:
            self.store.record_call(jobs=jobs, tokens=0, outcome=err.error_class, status=err.status,
                                   latency=time.monotonic() - started, billed=err.billed_maybe)
            self.report.add(provider_calls=1)
            self._had_failure = True
            self._handle_error(owner, jobs, err)
            return
        latency = time.monotonic() - started
        self.report.add(provider_calls=1, tokens=result.tokens)
        crashpoints.reach(crashpoints.AFTER_CALL, self.settings.crashpoint)
        stop = decisions.check_vectors([len(v) for v in result.vectors], jobs, expected=self._dimension,
                                       model_id=self.model_id)
        if stop is not None:
            self._stop(owner, stop)
            return
        if self._dimension is None:
            self._dimension = self.store.record_dimension(len(result.vectors[0]))
        ready, superseded = self.store.complete(owner=owner, jobs=jobs, vectors=result.vectors,
                                                tokens=result.tokens, latency=latency)
        if self._had_failure or any(j.probe for j in jobs):
            self.store.provider_healthy()
            self._had_failure = False
        refused = len(jobs) - len(ready) - len(superseded)
        self.report.add(embedded=len(ready), superseded=len(superseded), refused=refused)

    def _handle_error(self, owner: str, jobs: Sequence[ClaimedJob], err: ProviderError) -> None:
        outcome = self._decide(err, jobs)
        if isinstance(outcome, ProbeConfig):
            self._probe_config()
            outcome = self._decide(err, jobs)
        if isinstance(outcome, Split):
            first, second = outcome.halves
            self._call(owner, first)
            if self.stop.is_set() or self._provider_paused:
                self.store.give_back(owner=owner, job_ids=[j.job_id for j in second])
                return
            self._call(owner, second)
        elif isinstance(outcome, Fail):
            n = len(self.store.fail_terminal(owner=owner, job_ids=outcome.job_ids,
                                             error_class=outcome.error_class, message=outcome.message))
            self.report.add(failed=n)
        elif isinstance(outcome, GiveBack):
            # The provider's state, not the items': trip the shared breaker
            # and hand the items back without consuming their attempt.
            self.store.provider_failure(outcome.breaker)
            self.store.give_back(owner=owner, job_ids=outcome.job_ids, delay=outcome.delay,
                                 error_class=outcome.error_class, message=outcome.message)
            self._paused_until = time.monotonic() + outcome.pause
            self.report.add(throttled=len(outcome.job_ids))
        elif isinstance(outcome, Retry):
            if outcome.breaker is not None:
                self.store.provider_failure(outcome.breaker)
            moved = self.store.fail_retryable(owner=owner, job_ids=outcome.job_ids, delays=outcome.delays,
                                              error_class=outcome.error_class, message=outcome.message)
            self.report.add(retried=sum(1 for s in moved.values() if s == "retry"),
                            failed=sum(1 for s in moved.values() if s == "failed"))
        elif isinstance(outcome, Stop):
            self._stop(owner, outcome)

    def _decide(self, err: ProviderError, jobs: Sequence[ClaimedJob]) -> decisions.Outcome:
        return decisions.decide(err, jobs, config_ok=self._config_checked, base=self.settings.backoff_base,
                                cap=self.settings.backoff_cap, poll_seconds=self.config.poll_seconds)

    def _stop(self, owner: str, stop: Stop) -> None:
        """Not the items' fault: hand them back untouched and stop the worker."""
        self.store.give_back(owner=owner, job_ids=stop.job_ids)
        self._fatal = stop.error
        self.stop.set()

    def _probe_config(self) -> None:
        """One trivial request (a single token) tells a bad input from a bad
        configuration; asked once per worker, after the first 400."""
        started = time.monotonic()
        try:
            result = self.provider.embed([CONFIG_PROBE_TEXT])
            ok, tokens, outcome, status = True, result.tokens, "config_probe", 200
        except ProviderError as err:
            ok, tokens, outcome, status = err.kind != TERMINAL, 0, f"config_probe_{err.error_class}", err.status
        self._config_checked = ok
        self.store.record_call(jobs=[], tokens=tokens, outcome=outcome, status=status,
                               latency=time.monotonic() - started, billed=False)
        self.report.add(provider_calls=1)
