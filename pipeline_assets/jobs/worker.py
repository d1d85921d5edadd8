"""The worker: claim a batch, call the provider outside any transaction, complete.

Threads (``concurrency``) each loop claim -> call -> complete, taking a pooled
connection only for the short database steps (``JobStore``), so a slow provider
call holds no connection, no transaction and no row lock. A heartbeat thread
extends the leases of healthy calls; the per-call deadline bounds a stalled one.
A liveness thread keeps this worker's row in app.workers fresh. The main thread
rescues expired leases and the claims of dead workers, and decides when to stop.

What to do after an answer or an error is decided by the pure functions of
``jobs.decisions``; this module only carries the outcomes out.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import psycopg
from psycopg_pool import PoolTimeout

from pipeline_assets.jobs import crashpoints, decisions, leases, ledger, vector_index
from pipeline_assets.jobs.budget import TokenBudget
from pipeline_assets.jobs.decisions import Fail, GiveBack, ProbeConfig, Retry, Split, Stop
from pipeline_assets.jobs.faults import FaultCounter, WorkerFault
from pipeline_assets.jobs.job_log import LoggedJobStore as JobStore  # + a log line per job event, claims counted
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
    scope: Sequence[int] | None = None  # claim only the jobs of these documents (doc_pk); None: the whole queue


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
        # claim by the same worker id can never pass as the current lease. They
        # all start with this worker's prefix (a UUID per Worker), its row in
        # app.workers: when it stops beating, its claims are rescued.
        self._owner_prefix = f"{self.worker_id}/{uuid.uuid4()}/"
        self._claim_seq = itertools.count(1)
        self.stop = stop_event or threading.Event()
        self.report = WorkerReport()
        self.store: JobStore | None = None  # opened (with its pool) by run()
        self._leases = HeldLeases()
        self._idle = [False] * config.concurrency
        self._batch = min(config.batch_inputs or provider.spec.max_batch_inputs, provider.spec.max_batch_inputs)
        self._dimension: int | None = provider.spec.dimension  # recorded one wins, read in run()
        self._fatal: ProviderError | None = None
        self._fault: str | None = None  # why the worker stopped on faults of its own
        self._faults = FaultCounter()  # faults of our own since the last completion
        self._had_failure = False  # reset the shared failure count only after failures
        self._index_build: vector_index.BackgroundBuild | None = None  # started when the queue drains
        self._budget: str | None = None  # why claiming stopped on a budget
        self._config_checked: bool | None = None  # None: not probed yet
        self._paused_until = 0.0  # monotonic; a 429 seen here: send nothing more of held claims
        self._token_budget = TokenBudget.from_settings(self.model_id, settings)

    # -- lifecycle -------------------------------------------------------
    def run(self) -> WorkerReport:
        pool = db.make_pool(self.url, min_size=1, max_size=self.config.concurrency + 2)
        try:
            self.store = JobStore(pool, model_id=self.model_id, worker_id=self.worker_id, run=self._owner_prefix,
                                  backoff_base=self.settings.backoff_base, backoff_cap=self.settings.backoff_cap,
                                  scope=self.config.scope)
            self._run()
        finally:
            pool.close()
        if self._fatal is not None:
            self.report.fatal = self._fatal.message
            raise FatalProviderError(f"{self._fatal.error_class}: {self._fatal.message}")
        if self._fault is not None:
            raise WorkerFault(self._fault)
        if self._budget is not None:
            raise BudgetExhausted(self._budget)
        return self.report

    def _run(self) -> None:
        self._dimension = self.store.register_model(self.provider.spec)
        self._refresh_spend()  # before any claim: today's spend by other workers
        liveness = leases.Liveness(lambda: db.connect(self.url), owner_prefix=self._owner_prefix,
                                   worker_id=self.worker_id, model_id=self.model_id,
                                   dead_after=self.settings.worker_dead_after).start()
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
                        self.report.add(rescued=self.store.rescue(self._owner_prefix))
                        next_rescue = now + self.config.rescue_interval
                    self._refresh_spend()
                    if self._budget is not None:
                        break
                    if all(self._idle) and not self.store.outstanding():
                        if self._on_drained() and self.config.until_idle:
                            break
                except (psycopg.OperationalError, PoolTimeout) as exc:
                    # The database restarted or is unreachable for a moment:
                    # keep the worker, try again on the next beat.
                    log.warning("database unavailable in the worker's main loop: %s", exc)
                self.stop.wait(self.config.poll_seconds)
        finally:
            self.stop.set()
            if self._index_build is not None:
                self._index_build.cancel()  # an unfinished build is left INVALID; the next one replaces it
            deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            held = self._leases.take_all()
            handed_back = False
            try:
                if held:
                    self.store.give_back_all(held)
                handed_back = True
            finally:
                # Claims not handed back keep the row, which goes stale: they are rescued in seconds.
                liveness.stop(leave=handed_back)

    def _refresh_spend(self) -> None:
        if self._token_budget.daily:
            run_tokens = self.report.tokens
            # Others' tokens from the ledger (their unanswered sends at their estimate), ours as answered.
            self._token_budget.refresh(self.store.tokens_today_of_others() + run_tokens, run_tokens)

    def _on_drained(self) -> bool:
        """The queue is empty: build the model's missing vector index (in bulk: far cheaper than
        per insert during a backfill) beside this loop, concurrently (``vector_index``); an
        error is a logged warning. Returns whether `--until-idle` may exit (the build is over)."""
        if not self.config.build_index or not self._dimension:
            return True
        build = self._index_build
        if build is None or build.retry_due(time.monotonic()):
            self._index_build = build = vector_index.BackgroundBuild(
                lambda: db.connect(self.url), self.model_id, self._dimension).start()
        return build.done

    # -- one thread --------------------------------------------------------
    def _loop(self, index: int) -> None:
        while not self.stop.is_set():
            reason = self._token_budget.exceeded(self.report.tokens)
            if reason is not None:
                self._budget = reason
                self.stop.set()
                break
            owner = f"{self._owner_prefix}{next(self._claim_seq)}"
            try:
                jobs = self.store.claim(owner=owner, limit=self._batch, lease_seconds=self.config.lease_seconds)
            except Exception as exc:
                log.warning("claim failed: %s", exc)
                self._release(owner, [], exc)  # nothing held; counts towards stopping
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
                if jobs[0].probe:  # the probe ended without closing the breaker: the next claim may probe
                    self.store.release_probe(owner)
            except Exception as exc:  # a fault of our own (the database, a bug): not the items'
                if isinstance(exc, psycopg.Error):
                    log.warning("database fault; claim given back: %s", " ".join(str(exc).split()))
                else:
                    log.exception("batch failed in the worker")
                self._release(owner, jobs, exc)
            finally:
                self._leases.drop(owner)

    @property
    def _provider_paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def _release(self, owner: str, jobs: Sequence[ClaimedJob], exc: Exception) -> None:
        """Give the jobs back without using an attempt; stop after a few faults in a row."""
        consecutive, unavailable = self._faults.count(exc)
        release = decisions.worker_error(exc, jobs, consecutive=consecutive, unavailable=unavailable,
                                         base=self.settings.backoff_base, cap=self.settings.backoff_cap)
        try:
            self.store.give_back(owner=owner, job_ids=release.job_ids, delay=release.delay,
                                 error_class=release.error_class, message=release.message)
            if jobs and jobs[0].probe:
                self.store.release_probe(owner)
        except Exception:
            log.exception("could not hand back jobs; they return when their lease expires")
        if release.stop is not None and self._fault is None:
            self._fault = release.stop
            self.stop.set()

    def _call(self, owner: str, jobs: Sequence[ClaimedJob]) -> None:
        started = time.monotonic()
        # A healthy call keeps its lease for as long as it may take.
        self._leases.extend_deadline(owner, started + self.settings.call_timeout + self.config.lease_seconds)
        # The send is in the ledger before the request goes out: if no answer
        # ever comes (a kill, a failure), it still counts as possibly billed.
        call_id = self.store.record_send(jobs, sum(j.token_count or 0 for j in jobs))
        try:
            result = self.provider.embed([j.text for j in jobs])
        except ProviderError as err:
            self.store.record_failure(call_id, jobs, err, time.monotonic() - started)
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
            self.store.record_outcome(call_id, jobs, outcome="ok", status=200, latency=latency,
                                      billed=ledger.BILLED, tokens=result.tokens)
            self._stop(owner, stop)
            return
        if self._dimension is None:
            self._dimension = self.store.record_dimension(len(result.vectors[0]))
        vectors = result.vectors
        # One check of the whole answer; vector by vector only when it fails.
        bad = None if np.isfinite(np.concatenate(vectors)).all() else decisions.bad_vectors(
            [bool(np.isfinite(v).all()) for v in vectors], jobs,
            base=self.settings.backoff_base, cap=self.settings.backoff_cap)
        if bad is not None:  # NaN/inf: the provider's fault; retry those, complete the rest
            self._retry(owner, bad)
            jobs, vectors = decisions.without(bad.job_ids, jobs, vectors)
            if not jobs:
                self.store.record_outcome(call_id, [], outcome=bad.error_class, status=200, latency=latency,
                                          billed=ledger.BILLED, tokens=result.tokens)
                return
        ready, superseded = self.store.complete(owner=owner, jobs=jobs, vectors=vectors,
                                                tokens=result.tokens, latency=latency, call_id=call_id)
        self._faults.reset()
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
            # Input-specific: should the split be cut short, each goes alone next time.
            self.store.mark_isolated(owner=owner, job_ids=[j.job_id for j in jobs])
            first, second = outcome.halves
            self._call(owner, first)
            if self.stop.is_set() or self._provider_paused:
                self.store.give_back(owner=owner, job_ids=[j.job_id for j in second])
                return
            self._call(owner, second)
        elif isinstance(outcome, Fail):
            if outcome.breaker is not None:  # throttled past the cap: still a throttle for everyone else
                self.store.provider_failure(outcome.breaker)
                self._paused_until = time.monotonic() + outcome.pause
            n = len(self.store.fail_terminal(owner=owner, job_ids=outcome.job_ids,
                                             error_class=outcome.error_class, message=outcome.message))
            self.report.add(failed=n)
        elif isinstance(outcome, GiveBack):
            # The provider's state, not the items': trip the shared breaker
            # and hand the items back without consuming their attempt.
            self.store.provider_failure(outcome.breaker)
            self.store.give_back(owner=owner, job_ids=outcome.job_ids, delay=outcome.delay,
                                 error_class=outcome.error_class, message=outcome.message, throttled=True)
            self._paused_until = time.monotonic() + outcome.pause
            self.report.add(throttled=len(outcome.job_ids))
        elif isinstance(outcome, Retry):
            self._retry(owner, outcome)
        elif isinstance(outcome, Stop):
            self._stop(owner, outcome)

    def _retry(self, owner: str, outcome: Retry) -> None:
        if outcome.breaker is not None:
            self.store.provider_failure(outcome.breaker)
        moved = self.store.fail_retryable(owner=owner, job_ids=outcome.job_ids, delays=outcome.delays,
                                          error_class=outcome.error_class, message=outcome.message)
        self.report.add(retried=sum(1 for s in moved.values() if s == "retry"),
                        failed=sum(1 for s in moved.values() if s == "failed"))

    def _decide(self, err: ProviderError, jobs: Sequence[ClaimedJob]) -> decisions.Outcome:
        return decisions.decide(err, jobs, config_ok=self._config_checked, base=self.settings.backoff_base,
                                cap=self.settings.backoff_cap, poll_seconds=self.config.poll_seconds,
                                retry_after_cap=self.settings.retry_after_cap,
                                max_throttles=self.settings.max_throttles)

    def _stop(self, owner: str, stop: Stop) -> None:
        """Not the items' fault: hand them back untouched and stop the worker."""
        self.store.give_back(owner=owner, job_ids=stop.job_ids)
        self._fatal = stop.error
        self.stop.set()

    def _probe_config(self) -> None:
        """One trivial request (a single token) tells a bad input from a bad
        configuration; asked once per worker, after the first 400."""
        started = time.monotonic()
        call_id = self.store.record_send([], 1)
        try:
            result = self.provider.embed([CONFIG_PROBE_TEXT])
            ok = True
            self.store.record_outcome(call_id, [], outcome="config_probe", status=200,
                                      latency=time.monotonic() - started, billed=ledger.BILLED, tokens=result.tokens)
        except ProviderError as err:
            ok = err.kind != TERMINAL
            self.store.record_failure(call_id, [], err, time.monotonic() - started, prefix="config_probe_")
        self._config_checked = ok
        self.report.add(provider_calls=1)
