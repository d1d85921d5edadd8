"""One claim, executed: plan its requests (``jobqueue.request_plan``), call the provider outside any
transaction, decide (``jobqueue.decisions``) and apply the transitions it decided (``JobStore.apply``),
after River's executor/completer split: this module decides what each job becomes; the store
applies it. What it asks the provider itself (the configuration probe, whether it answers others)
is ``jobqueue.provider_checks``'. ``Stopping`` holds why the worker stops (the first reason wins).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import psycopg

from pipeline_assets.jobqueue import answer_checks, crashpoints, decisions, request_plan
from pipeline_assets.jobqueue.changes import Change, ClaimedJob, Complete, GiveBack, Isolate, Supersede
from pipeline_assets.jobqueue.decisions import DOWN
from pipeline_assets.jobqueue.evidence import FAULT, SUCCESS, THROTTLE
from pipeline_assets.jobqueue.executor_config import ExecutorConfig
from pipeline_assets.jobqueue.faults import DatabaseWait, FaultCounter
from pipeline_assets.jobqueue.job_store import Answer, JobStore
from pipeline_assets.jobqueue.leases import HeldLeases
from pipeline_assets.jobqueue.outcomes import Apply, CheckProvider, Outcome, ProbeConfig, Split, Stop
from pipeline_assets.jobqueue.provider_checks import ProviderChecks, ProviderView, embed
from pipeline_assets.jobqueue.report import WorkerReport
from pipeline_assets.messages import one_line
from pipeline_assets.providers import RETRYABLE, THROTTLED, Provider, ProviderError

log = logging.getLogger("pipeline_assets.jobqueue.worker")

T = TypeVar("T")


@dataclass
class Stopping:
    """Why the worker stops: a fatal provider error, faults of our own, a budget."""

    event: threading.Event
    fatal: ProviderError | None = None
    fault: str | None = None
    budget: str | None = None

    def stop(self, *, fatal: ProviderError | None = None, fault: str | None = None, budget: str | None = None) -> None:
        if self.fatal is None and self.fault is None and self.budget is None:
            self.fatal, self.fault, self.budget = fatal, fault, budget
        self.event.set()


@dataclass
class Executor:
    provider: Provider
    store: JobStore
    config: ExecutorConfig
    poll_seconds: float
    lease_seconds: float
    report: WorkerReport
    stopping: Stopping
    view: ProviderView
    leases: HeldLeases = field(default_factory=HeldLeases)
    faults: FaultCounter = field(default_factory=FaultCounter)  # faults of our own since the last completion
    db_wait: DatabaseWait = field(default_factory=DatabaseWait)  # the database's unavailability, waited out
    checks: ProviderChecks = field(init=False)  # the trivial requests that ask the provider itself

    def __post_init__(self) -> None:
        self.checks = ProviderChecks(self.provider, self.store, self.report, self.view, stop_event=self.stopping.event)

    def check_at_start(self) -> None:
        """Before claiming anything: stop at once if the provider still answers nothing usable
        (``ProviderChecks.unusable_at_start``)."""
        error = self.checks.unusable_at_start()
        if error is not None:
            self.stopping.stop(fatal=error)

    # -- a claim -------------------------------------------------------------------
    def run_claim(self, owner: str, jobs: Sequence[ClaimedJob], batch: int) -> None:
        fault_threshold, throttle_threshold = self._thresholds()
        requests = request_plan.plan_requests(
            jobs,
            max_inputs=batch,
            max_tokens=self.provider.spec.max_batch_tokens,
            fault_threshold=fault_threshold,
            throttle_threshold=throttle_threshold,
        )
        budget = self.config.call_timeout * (len(requests) + 1) + self.lease_seconds
        self.leases.hold(owner, [j.job_id for j in jobs], time.monotonic() + budget)
        try:
            crashpoints.reach(crashpoints.AFTER_CLAIM, self.config.crashpoint)
            gone = request_plan.unwanted(jobs)
            if gone:
                self.store.apply(owner, [Supersede(tuple(gone))])
            for n, request in enumerate(requests):
                if self.stopping.event.is_set() or self.view.paused:
                    # Stopping, or the provider just throttled us: hand back
                    # what was not sent instead of hammering it.
                    self.store.apply(owner, [GiveBack(tuple(j.job_id for r in requests[n:] for j in r))])
                    break
                self.call(owner, request)
            if jobs[0].probe:  # the probe ended without closing the breaker: the next claim may probe
                self.store.release_probe(owner)
        except Exception as exc:  # a fault of our own (the database, a bug): not the items'
            if self.db_wait.failed(exc):
                pass  # logged once per outage; the give-back below waits for the database
            elif isinstance(exc, psycopg.Error):
                log.warning("database fault; claim given back: %s", one_line(exc))
            else:
                log.exception("batch failed in the worker")
            self.release(owner, jobs, exc)
        finally:
            self.leases.drop(owner)

    def release(self, owner: str, jobs: Sequence[ClaimedJob], exc: Exception) -> None:
        """Give the jobs back without using an attempt; stop after a few faults in a row."""
        consecutive, unavailable = self.faults.count(exc)
        outcome = decisions.worker_error(
            exc,
            jobs,
            consecutive=consecutive,
            unavailable=unavailable,
            base=self.config.backoff_base,
            cap=self.config.backoff_cap,
        )
        try:
            self._ride_out(owner, lambda: self.store.apply(owner, outcome.changes))
            if jobs and jobs[0].probe:
                self.store.release_probe(owner)
        except Exception as err:
            if self.db_wait.failed(err):  # stopping while the database is away
                log.warning(
                    "could not hand back jobs (the database is unavailable); they return when "
                    "their lease expires, without using an attempt: %s",
                    one_line(err),
                )
            else:
                log.exception("could not hand back jobs; they return when their lease expires")
        if outcome.stop_reason is not None:
            self.stopping.stop(fault=outcome.stop_reason)

    def release_now(self, owner: str, jobs: Sequence[ClaimedJob]) -> None:
        """Hand claimed jobs back at once, untouched (no attempt used, nothing counted)."""
        try:
            self._ride_out(owner, lambda: self.store.apply(owner, [GiveBack(tuple(j.job_id for j in jobs))]))
        except Exception as exc:  # their lease expires and they are rescued
            log.warning("could not hand back jobs; they return when their lease expires: %s", one_line(exc))

    def _ride_out(self, owner: str, step: Callable[[], T]) -> T:
        """``step`` (a database step of the claim ``owner``), waiting while the database is
        unavailable; the wait does not count against the claim's deadline, so the heartbeat
        keeps its lease once the database is back."""
        return self.db_wait.ride_out(
            step,
            self.stopping.event,
            on_wait=lambda: self.leases.extend_deadline(
                owner, time.monotonic() + self.config.call_timeout + self.lease_seconds
            ),
        )

    # -- a request -----------------------------------------------------------------
    def call(self, owner: str, jobs: Sequence[ClaimedJob]) -> None:
        started = time.monotonic()
        # A healthy call keeps its lease for as long as it may take.
        self.leases.extend_deadline(owner, started + self.config.call_timeout + self.lease_seconds)
        # The send is in the ledger before the request goes out: if no answer
        # ever comes (a kill, a failure), it still counts as possibly billed.
        call_id = self.store.record_send(jobs, sum(j.token_count or 0 for j in jobs))
        try:
            # Requests carry only jobs with text (plan_requests leaves the unwanted out).
            result = embed(self.provider, [j.text for j in jobs if j.text is not None])
        except ProviderError as err:
            self.store.record_failure(call_id, err, time.monotonic() - started)
            self.report.add(provider_calls=1)
            self.view.had_failure = True
            outcome = self._decide(err, jobs, started)
            if err.kind in (THROTTLED, RETRYABLE):
                self.view.rates.record(THROTTLE if err.kind == THROTTLED else FAULT)
            if err.kind == THROTTLED or (
                err.kind == RETRYABLE and not (isinstance(outcome, Apply) and outcome.charged)
            ):
                self.view.limit.failed()  # the provider's: fewer requests in flight
            self.carry_out(owner, jobs, outcome)
            return
        latency = time.monotonic() - started
        self.report.add(provider_calls=1, tokens=result.tokens)
        self.view.last_usable = time.monotonic()
        self.view.limit.answered()
        self.view.rates.record(SUCCESS)
        crashpoints.reach(crashpoints.AFTER_CALL, self.config.crashpoint, (j.text for j in jobs))
        answer = Answer(call_id, result.tokens, latency)
        stop = answer_checks.check_vectors(
            [len(v) for v in result.vectors], jobs, expected=self.view.dimension, model_id=self.provider.spec.model_id
        )
        if stop is not None:
            self.store.apply(owner, [], answer=answer)
            self.carry_out(owner, jobs, stop)
            return
        if self.view.dimension is None:
            self.view.dimension = self.store.record_dimension(len(result.vectors[0]))
        vectors = result.vectors
        changes: list[Change] = []
        # One check of the whole answer; vector by vector only when it fails.
        bad = (
            None
            if np.isfinite(np.concatenate(vectors)).all()
            else answer_checks.bad_vectors(
                [bool(np.isfinite(v).all()) for v in vectors],
                jobs,
                base=self.config.backoff_base,
                cap=self.config.backoff_cap,
            )
        )
        if bad is not None:  # NaN/inf: the provider's fault, for those inputs; the rest complete
            if bad.breaker is not None:
                self.store.provider_failure(bad.breaker)
            changes.extend(bad.changes)
            jobs, vectors = answer_checks.without(bad.changes[0].job_ids, jobs, vectors)
        changes.append(Complete(tuple(j.job_id for j in jobs), tuple(vectors)))
        # Paid-for vectors: while the database is unavailable the completion waits and is tried again.
        self._ride_out(owner, lambda: self.store.apply(owner, changes, answer=answer))
        self.faults.reset()
        if jobs and (self.view.had_failure or any(j.probe for j in jobs)):
            self.checks.usable()

    def carry_out(self, owner: str, jobs: Sequence[ClaimedJob], outcome: Outcome) -> None:
        """Apply a decision about a request (``_decide`` has already asked the configuration probe)."""
        if isinstance(outcome, Split):
            # Input-specific: should the split be cut short, each goes alone next time.
            self.store.apply(owner, [Isolate(tuple(j.job_id for j in jobs))])
            first, second = outcome.halves
            self.call(owner, first)
            if self.stopping.event.is_set() or self.view.paused:
                self.store.apply(owner, [GiveBack(tuple(j.job_id for j in second))])
                return
            self.call(owner, second)
        elif isinstance(outcome, Stop):
            # Not the items' fault: hand them back untouched and stop the worker.
            self.store.apply(owner, [GiveBack(outcome.job_ids)])
            self.stopping.stop(fatal=outcome.error)
        elif isinstance(outcome, Apply):
            if outcome.pause:  # first: this process's other threads see it before the database round trip
                self.view.paused_until = time.monotonic() + outcome.pause
            if outcome.breaker is not None:
                self.store.provider_failure(outcome.breaker)
            if outcome.unusable:
                log.info(
                    "the provider answered nothing usable even to a single trivial input "
                    "(%d in a row); the request was given back, nothing charged",
                    self.view.unusable,
                )
            self.store.apply(owner, outcome.changes)

    def _thresholds(self) -> tuple[int, int]:
        """The fault and throttle counts from which they are evidence against a job's inputs."""
        rates = self.view.rates
        return rates.fault_threshold(), rates.throttle_threshold(request_plan.THROTTLE_SHRINK_AFTER)

    def _decide(
        self, err: ProviderError, jobs: Sequence[ClaimedJob], started: float, health: str | None = None
    ) -> Outcome:
        fault_threshold, throttle_threshold = self._thresholds()
        outcome = decisions.decide(
            err,
            jobs,
            config_ok=self.view.config_ok,
            base=self.config.backoff_base,
            cap=self.config.backoff_cap,
            poll_seconds=self.poll_seconds,
            retry_after_cap=self.config.retry_after_cap,
            max_throttles=self.config.max_throttles,
            health=health,
            unusable_in_a_row=max(0, self.view.unusable - 1),
            fault_threshold=fault_threshold,
            throttle_threshold=throttle_threshold,
        )
        if isinstance(outcome, ProbeConfig):
            self.checks.probe_config()
            return self._decide(err, jobs, started, health)
        if isinstance(outcome, CheckProvider):
            # A failed probe of a tripped breaker: the provider answers nobody, nothing to ask.
            health = DOWN if any(j.probe for j in jobs) else self.checks.check_provider(started)
            return self._decide(err, jobs, started, health)
        return outcome
