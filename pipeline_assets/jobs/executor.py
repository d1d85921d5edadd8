"""One claim, executed: plan its requests, call the provider outside any
transaction, decide (``jobs.decisions``) and apply the transitions it decided
(``JobStore.apply``), after River's executor/completer split: this module
decides what each job becomes; the store applies it.

``ProviderView`` is what the worker has learnt of the provider (its dimension,
the configuration probe's answer, a local pause after a throttle, whether a
failure was seen, when it last answered usably, the outcomes of recent requests
(``jobs.evidence``) and the limit on requests in flight (``jobs.send_limit``)),
shared by the worker's threads. ``Stopping`` holds why the worker stops (the
first reason wins).
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

from pipeline_assets.jobs import crashpoints, decisions, ledger, request_plan
from pipeline_assets.jobs.changes import Change, ClaimedJob, Complete, GiveBack, Isolate, Supersede
from pipeline_assets.jobs.decisions import ANSWERS, DOWN, UNUSABLE, Apply, CheckProvider, ProbeConfig, Split, Stop
from pipeline_assets.jobs.evidence import FAULT, SUCCESS, THROTTLE, ProviderRates
from pipeline_assets.jobs.executor_config import ExecutorConfig
from pipeline_assets.jobs.faults import DatabaseWait, FaultCounter, one_line
from pipeline_assets.jobs.job_store import Answer, JobStore
from pipeline_assets.jobs.leases import HeldLeases
from pipeline_assets.jobs.report import WorkerReport
from pipeline_assets.jobs.send_limit import SendLimit
from pipeline_assets.jobs.worker_config import DEFAULT_CONCURRENCY
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, EmbedResult, Provider, ProviderError

log = logging.getLogger("pipeline_assets.jobs.worker")

T = TypeVar("T")

# The trivial input that tells a bad configuration from a bad input after a 400,
# and a provider that answers nobody from a bad input after a transient failure.
CONFIG_PROBE_TEXT = "ping"
# A usable answer this recent (before a failed request was sent, or any time
# after) shows the provider answers others: no trivial request is needed to know it.
RECENT_ANSWER_SECONDS = 5.0
# Trivial requests a check sends before it judges the provider down (each one a token): with
# 40% of requests failing at random, three fail together 6% of the time.
CHECK_TRIES = 3


@dataclass
class Stopping:
    """Why the worker stops: a fatal provider error, faults of our own, a budget."""
    event: threading.Event
    fatal: ProviderError | None = None
    fault: str | None = None
    budget: str | None = None

    def stop(self, *, fatal: ProviderError | None = None, fault: str | None = None,
             budget: str | None = None) -> None:
        if self.fatal is None and self.fault is None and self.budget is None:
            self.fatal, self.fault, self.budget = fatal, fault, budget
        self.event.set()


@dataclass
class ProviderView:
    dimension: int | None                  # the model's, once known (the recorded one wins)
    config_ok: bool | None = None          # the configuration probe's answer (None: not asked)
    paused_until: float = 0.0              # monotonic; a 429 seen here: send nothing more of held claims
    had_failure: bool = False              # reset the shared failure count only after failures
    unusable: int = 0                      # unusable answers in a row, as last read from the database
    last_usable: float = float("-inf")     # monotonic; the provider's last usable answer to this worker
    checked: tuple[float, str] = (float("-inf"), ANSWERS)  # monotonic start and verdict of the last check
    rates: ProviderRates = field(default_factory=ProviderRates)
    limit: SendLimit = field(default_factory=lambda: SendLimit(DEFAULT_CONCURRENCY))
    check_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def paused(self) -> bool:
        return time.monotonic() < self.paused_until


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

    # -- a claim -------------------------------------------------------------------
    def run_claim(self, owner: str, jobs: Sequence[ClaimedJob], batch: int) -> None:
        fault_threshold, throttle_threshold = self._thresholds()
        requests = request_plan.plan_requests(jobs, max_inputs=batch, max_tokens=self.provider.spec.max_batch_tokens,
                                           fault_threshold=fault_threshold, throttle_threshold=throttle_threshold)
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
                log.warning("database fault; claim given back: %s", " ".join(str(exc).split()))
            else:
                log.exception("batch failed in the worker")
            self.release(owner, jobs, exc)
        finally:
            self.leases.drop(owner)

    def release(self, owner: str, jobs: Sequence[ClaimedJob], exc: Exception) -> None:
        """Give the jobs back without using an attempt; stop after a few faults in a row."""
        consecutive, unavailable = self.faults.count(exc)
        outcome = decisions.worker_error(exc, jobs, consecutive=consecutive, unavailable=unavailable,
                                         base=self.config.backoff_base, cap=self.config.backoff_cap)
        try:
            self._ride_out(owner, lambda: self.store.apply(owner, outcome.changes))
            if jobs and jobs[0].probe:
                self.store.release_probe(owner)
        except Exception as err:
            if self.db_wait.failed(err):  # stopping while the database is away
                log.warning("could not hand back jobs (the database is unavailable); they return when "
                            "their lease expires, without using an attempt: %s", one_line(err))
            else:
                log.exception("could not hand back jobs; they return when their lease expires")
        if outcome.stop is not None:
            self.stopping.stop(fault=outcome.stop)

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
        return self.db_wait.ride_out(step, self.stopping.event, on_wait=lambda: self.leases.extend_deadline(
            owner, time.monotonic() + self.config.call_timeout + self.lease_seconds))

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
            result = _embed(self.provider, [j.text for j in jobs if j.text is not None])
        except ProviderError as err:
            self.store.record_failure(call_id, err, time.monotonic() - started)
            self.report.add(provider_calls=1)
            self.view.had_failure = True
            outcome = self._decide(err, jobs, started)
            if err.kind in (THROTTLED, RETRYABLE):
                self.view.rates.record(THROTTLE if err.kind == THROTTLED else FAULT)
            if err.kind == THROTTLED or (err.kind == RETRYABLE and not (isinstance(outcome, Apply)
                                                                      and outcome.charged)):
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
        stop = decisions.check_vectors([len(v) for v in result.vectors], jobs, expected=self.view.dimension,
                                       model_id=self.provider.spec.model_id)
        if stop is not None:
            self.store.apply(owner, [], answer=answer)
            self.carry_out(owner, jobs, stop)
            return
        if self.view.dimension is None:
            self.view.dimension = self.store.record_dimension(len(result.vectors[0]))
        vectors = result.vectors
        changes: list[Change] = []
        # One check of the whole answer; vector by vector only when it fails.
        bad = None if np.isfinite(np.concatenate(vectors)).all() else decisions.bad_vectors(
            [bool(np.isfinite(v).all()) for v in vectors], jobs,
            base=self.config.backoff_base, cap=self.config.backoff_cap)
        if bad is not None:  # NaN/inf: the provider's fault, for those inputs; the rest complete
            if bad.breaker is not None:
                self.store.provider_failure(bad.breaker)
            changes.extend(bad.changes)
            jobs, vectors = decisions.without(bad.changes[0].job_ids, jobs, vectors)
        changes.append(Complete(tuple(j.job_id for j in jobs), tuple(vectors)))
        # Paid-for vectors: while the database is unavailable the completion waits and is tried again.
        self._ride_out(owner, lambda: self.store.apply(owner, changes, answer=answer))
        self.faults.reset()
        if jobs and (self.view.had_failure or any(j.probe for j in jobs)):
            self._usable()

    def carry_out(self, owner: str, jobs: Sequence[ClaimedJob], outcome: decisions.Outcome) -> None:
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
            if outcome.breaker is not None:
                self.store.provider_failure(outcome.breaker)
            if outcome.pause:
                self.view.paused_until = time.monotonic() + outcome.pause
            if outcome.unusable:
                log.info("the provider answered nothing usable even to a single trivial input "
                         "(%d in a row); the request was given back, nothing charged", self.view.unusable)
            self.store.apply(owner, outcome.changes)

    def _thresholds(self) -> tuple[int, int]:
        """The fault and throttle counts from which they are evidence against a job's inputs."""
        rates = self.view.rates
        return rates.fault_threshold(), rates.throttle_threshold(request_plan.THROTTLE_SHRINK_AFTER)

    def _decide(self, err: ProviderError, jobs: Sequence[ClaimedJob], started: float,
                health: str | None = None) -> decisions.Outcome:
        fault_threshold, throttle_threshold = self._thresholds()
        outcome = decisions.decide(err, jobs, config_ok=self.view.config_ok, base=self.config.backoff_base,
                                   cap=self.config.backoff_cap, poll_seconds=self.poll_seconds,
                                   retry_after_cap=self.config.retry_after_cap,
                                   max_throttles=self.config.max_throttles, health=health,
                                   unusable_in_a_row=max(0, self.view.unusable - 1),
                                   fault_threshold=fault_threshold, throttle_threshold=throttle_threshold)
        if isinstance(outcome, ProbeConfig):
            self._probe_config()
            return self._decide(err, jobs, started, health)
        if isinstance(outcome, CheckProvider):
            # A failed probe of a tripped breaker: the provider answers nobody, nothing to ask.
            health = DOWN if any(j.probe for j in jobs) else self.check_provider(started)
            return self._decide(err, jobs, started, health)
        return outcome

    def check_provider(self, sent_at: float) -> str:
        """Does the provider answer others? ``ANSWERS`` if a usable answer came
        shortly before ``sent_at`` or since; otherwise one trivial request tells
        (asked once by the worker's threads together: a check started after
        ``sent_at`` answers for every request sent before it; up to
        ``CHECK_TRIES`` of them while they fail). An unusable answer to it is
        counted in the database (every worker, across restarts)."""
        with self.view.check_lock:
            if self.view.last_usable >= sent_at - RECENT_ANSWER_SECONDS:
                return ANSWERS
            checked_at, verdict = self.view.checked
            if checked_at >= sent_at:
                return verdict
            checked_at = time.monotonic()
            for _ in range(CHECK_TRIES):  # a flaky provider fails one trivial request, rarely all
                result, err = self._trivial_call("health_probe")
                self.view.rates.record(SUCCESS if err is None else THROTTLE if err.kind == THROTTLED else FAULT)
                if err is None or err.kind not in (RETRYABLE, THROTTLED) \
                        or err.error_class == decisions.UNMATCHED_ANSWER:
                    break
            if err is None and result is not None and len(result.vectors) == 1:
                self.view.last_usable = time.monotonic()
                verdict = ANSWERS
                if self.view.unusable:
                    self._usable()
            elif err is None or err.error_class == decisions.UNMATCHED_ANSWER:
                verdict = UNUSABLE
                self.view.unusable = self.store.provider_unusable()
                self.view.had_failure = True
            else:
                verdict = DOWN
            self.view.checked = (checked_at, verdict)
            return verdict

    def check_at_start(self) -> None:
        """Before claiming anything: if the provider's last answers (any worker's) were
        unusable up to the stop, one trivial request decides whether to stop again at once."""
        self.view.unusable = self.store.provider_unusable(count=False)
        if self.view.unusable < decisions.MAX_UNMATCHED_ANSWERS:
            return
        self.view.had_failure = True
        if self.check_provider(time.monotonic()) == UNUSABLE:
            self.stopping.stop(fatal=ProviderError(
                FATAL, decisions.UNMATCHED_ANSWERS,
                f"the provider sent {self.view.unusable} answers in a row that cannot be matched to their inputs, "
                "the last to a single trivial input, and still does; nothing was claimed: check the endpoint "
                "(OPENAI_BASE_URL) or the proxy in front of it"))

    def _usable(self) -> None:
        """A usable answer after failures: close the breaker, reset the unusable answers in a row."""
        self.store.provider_healthy()
        self.view.had_failure = False
        self.view.unusable = 0

    def _trivial_call(self, outcome: str) -> tuple[EmbedResult, None] | tuple[None, ProviderError]:
        """One trivial request (``"ping"``, one token), in the ledger: (result, None) or (None, error)."""
        started = time.monotonic()
        call_id = self.store.record_send([], 1)
        self.report.add(provider_calls=1)
        try:
            result = _embed(self.provider, [CONFIG_PROBE_TEXT])
        except ProviderError as err:
            self.store.record_failure(call_id, err, time.monotonic() - started, prefix=outcome + "_")
            return None, err
        self.store.record_outcome(call_id, outcome=outcome, status=200, latency=time.monotonic() - started,
                                  billed=ledger.BILLED, tokens=result.tokens)
        return result, None

    def _probe_config(self) -> None:
        """One trivial request (a single token) tells a bad input from a bad
        configuration; asked once per worker, after the first 400."""
        _, err = self._trivial_call("config_probe")
        self.view.config_ok = err is None or err.kind != TERMINAL


def _embed(provider: Provider, texts: list[str]) -> EmbedResult:
    """The provider's answer; an answer its SDK could not parse at all (the openai SDK raises a
    bare ValueError for an answer with no embedding, e.g. a proxy that dropped the only one) is
    an unusable answer of the provider, as a wrong count of vectors is, not a fault of ours."""
    try:
        return provider.embed(texts)
    except ValueError as exc:
        raise ProviderError(RETRYABLE, decisions.UNMATCHED_ANSWER,
                            f"unusable answer for {len(texts)} inputs: {exc}") from None
