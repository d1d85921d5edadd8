"""The worker's decisions, as pure functions: no database, no provider, no clock.

``decide`` maps a provider error and the jobs of its request to an outcome (``jobqueue.outcomes``:
``Apply`` transitions, ``Split`` a bad input away, ``Stop``, or ask ``ProbeConfig`` /
``CheckProvider`` and decide again); ``worker_error`` handles a fault of our own;
``alone_if_suspect`` keeps a suspect alone in its claim (which jobs share a request is
``jobqueue.request_plan``'s; a successful answer is judged by ``jobqueue.answer_checks``). The
transitions are the plain values of ``jobqueue.changes``; the worker carries the outcomes out
through ``JobStore.apply``. Who is charged for a fault, and when the worker stops:
docs/state-machine.md, "Who pays for a fault".
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pipeline_assets.jobqueue import backoff
from pipeline_assets.jobqueue.changes import ClaimedJob, Fail, GiveBack, Retry
from pipeline_assets.jobqueue.outcomes import Apply, BreakerFailure, CheckProvider, Outcome, ProbeConfig, Split, Stop
from pipeline_assets.jobqueue.request_plan import FREE_FAULTS, THROTTLE_SHRINK_AFTER, fault_level
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, ProviderError, sanitize

# Answers in a row with nothing usable in them, even to one trivial input (a
# wrong count of vectors, a duplicate or missing index), after which the worker
# stops: counted in app.provider_state.unusable_answers (every worker, across
# restarts; any usable answer resets it), so a restarted worker checks first.
MAX_UNMATCHED_ANSWERS = 3

# The provider's health, as the worker judges it after a transient failure.
ANSWERS = "answers"  # it answered other requests usably: the failure points at the request's inputs
DOWN = "down"  # it answers nobody: the failure is the provider's alone
UNUSABLE = "unusable"  # it answers, but nothing usable even to one trivial input
# The error class the worker stops with after MAX_UNMATCHED_ANSWERS answers that cannot be
# matched to their inputs (each of them a ``providers.base.BAD_RESPONSE``).
TOO_MANY_UNMATCHED_ANSWERS = "unmatched_answers"

# Faults of our own in a row (database, infrastructure, bugs) after which the
# worker stops: a persistent fault (a missing privilege, a full disk) stops it
# with a one-line error instead of cycling the corpus through give-backs.
MAX_CONSECUTIVE_WORKER_FAULTS = 3

# The error class of a give-back for a fault of our own.
WORKER_ERROR = "worker_error"
# The error class of a single input throttled more than ``max_throttles`` times.
THROTTLED_TOO_OFTEN = "throttled_too_often"


# -- a claim ---------------------------------------------------------------------------


def suspect(job: ClaimedJob, threshold: int = 1) -> bool:
    """A job that met ``FREE_FAULTS`` faults past the evidence threshold (``jobqueue.evidence``),
    worked alone in its process (``jobqueue.suspects``): its next crash may be its own doing. After
    a crash (``crashed``) every fault counts, as ``rescue_expired`` counts them."""
    return fault_level(job.faults, 1 if job.crashed else threshold) >= FREE_FAULTS


def alone_if_suspect(jobs: Sequence[ClaimedJob], threshold: int = 1) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
    """A claim holding a suspect keeps that job alone (the first such) and hands the others
    back: should it crash its worker, the rescue finds it the only job of the dead process
    and charges it (``rescue_expired``), not its neighbours. Returns (the jobs kept, the jobs
    to hand back)."""
    first = next((j for j in jobs if suspect(j, threshold)), None)
    if first is None or len(jobs) == 1:
        return list(jobs), []
    return [first], [j for j in jobs if j is not first]


# -- deciding --------------------------------------------------------------------------


def retry_delays(
    jobs: Sequence[ClaimedJob],
    *,
    base: float,
    cap: float,
    retry_after: float | None = None,
    rng: random.Random | None = None,
) -> tuple[float, ...]:
    """Each job's next retry: full jitter over its attempts, never before Retry-After."""
    return tuple(backoff.retry_delay(j.attempts, base=base, cap=cap, retry_after=retry_after, rng=rng) for j in jobs)


def decide(
    error: ProviderError,
    jobs: Sequence[ClaimedJob],
    *,
    config_ok: bool | None,
    base: float,
    cap: float,
    poll_seconds: float,
    retry_after_cap: float | None = None,
    max_throttles: int | None = None,
    health: str | None = ANSWERS,
    unusable_in_a_row: int = 0,
    fault_threshold: int = 1,
    throttle_threshold: int = THROTTLE_SHRINK_AFTER,
    rng: random.Random | None = None,
) -> Outcome:
    """What to do with the jobs of a request the provider refused.

    ``config_ok``: the configuration probe's answer (None: not asked yet); after a 400 it is asked first,
    and if a trivial input fails too the worker stops instead of dead-lettering the corpus. ``base`` and
    ``cap`` bound the backoff, ``poll_seconds`` is the shortest pause after a throttle, ``retry_after_cap``
    bounds the provider's Retry-After, ``max_throttles`` the throttles one input may take before it is
    dead-lettered (``throttled_too_often``; raised by as much as the throttle evidence threshold is above
    its lowest). ``health``: what the provider does for others (None: not asked yet; asked only after a
    transient failure); ``unusable_in_a_row``: unusable answers to single trivial inputs in a row (every
    worker); ``fault_threshold``/``throttle_threshold``: the evidence thresholds (``jobqueue.evidence``).
    """
    ids = tuple(j.job_id for j in jobs)
    retry_after = error.retry_after
    if retry_after is not None and retry_after_cap is not None:
        retry_after = min(retry_after, retry_after_cap)
    if error.kind == TERMINAL:
        if config_ok is None:
            return ProbeConfig()
        if not config_ok:
            return Stop(ids, ProviderError(FATAL, "config_rejected", error.message, error.status))
        if len(jobs) > 1:
            mid = len(jobs) // 2
            return Split((tuple(jobs[:mid]), tuple(jobs[mid:])))
        return Apply((Fail(ids, error.error_class, error.message),))
    floor = retry_after or 0.0
    if error.kind == THROTTLED:
        breaker, pause = BreakerFailure(trip=False, floor=floor, pause_only=True), max(floor, poll_seconds)
        cap_throttles = None if max_throttles is None else max_throttles + throttle_threshold - THROTTLE_SHRINK_AFTER
        if len(jobs) == 1 and cap_throttles is not None and jobs[0].throttles + 1 > cap_throttles:
            return Apply(
                (
                    Fail(
                        ids,
                        THROTTLED_TOO_OFTEN,
                        sanitize(
                            f"throttled {jobs[0].throttles + 1} times, alone in its request "
                            f"(cap {cap_throttles}): {error.message}"
                        ),
                    ),
                ),
                breaker,
                pause,
            )
        return Apply((GiveBack(ids, floor, error.error_class, error.message, throttled=True),), breaker, pause)
    if error.kind == RETRYABLE:
        if health is None:
            return CheckProvider()
        return _transient(
            error,
            jobs,
            floor=floor,
            base=base,
            cap=cap,
            health=health,
            unusable_in_a_row=unusable_in_a_row,
            threshold=fault_threshold,
            rng=rng,
        )
    if error.kind == FATAL:
        return Stop(ids, error)
    raise ValueError(f"unknown provider error kind {error.kind!r}")


def _transient(
    error: ProviderError,
    jobs: Sequence[ClaimedJob],
    *,
    floor: float,
    base: float,
    cap: float,
    health: str,
    unusable_in_a_row: int,
    threshold: int,
    rng: random.Random | None,
) -> Outcome:
    """A transient failure (an unusable answer included): the request's while
    the provider answers others; the provider's alone while it answers nobody
    (nothing is counted on the jobs: an outage of any length shrinks and
    charges nothing); to an input only when it keeps failing alone."""
    ids = tuple(j.job_id for j in jobs)
    breaker = BreakerFailure(trip=False, floor=floor)
    if health != ANSWERS:
        # The provider's: a short spread-out retry; its pace is the breaker's and the send limit's.
        delay = backoff.retry_delay(0, base=base, cap=cap, retry_after=floor or None, rng=rng)
        if health == UNUSABLE:
            seen = unusable_in_a_row + 1
            if seen >= MAX_UNMATCHED_ANSWERS:
                return Stop(
                    ids,
                    ProviderError(
                        FATAL,
                        TOO_MANY_UNMATCHED_ANSWERS,
                        (
                            f"the provider sent {seen} answers in a row that cannot be matched to their inputs, "
                            f"the last to a single trivial input (last: {error.message}); nothing unusable was stored "
                            "and no attempt used: check the endpoint (OPENAI_BASE_URL) or the proxy in front of it"
                        ),
                        error.status,
                    ),
                )
            return Apply((GiveBack(ids, delay, error.error_class, error.message),), breaker, unusable=True)
        return Apply((GiveBack(ids, delay, error.error_class, error.message),), breaker)
    level = max(fault_level(j.faults, threshold) for j in jobs)
    if len(jobs) == 1 and level >= FREE_FAULTS:  # failing alone, again: its attempt counts
        return Apply(
            (
                Retry(
                    ids,
                    retry_delays(jobs, base=base, cap=cap, retry_after=floor or None, rng=rng),
                    error.error_class,
                    error.message,
                ),
            ),
            charged=True,
        )
    delay = backoff.retry_delay(level, base=base, cap=cap, retry_after=floor or None, rng=rng)
    return Apply((GiveBack(ids, delay, error.error_class, error.message, faulted=True),), charged=True)


def worker_error(
    exc: BaseException,
    jobs: Sequence[ClaimedJob],
    *,
    consecutive: int,
    unavailable: bool,
    base: float,
    cap: float,
    rng: random.Random | None = None,
) -> Apply:
    """A fault of our own while a claim was held (a database error after the
    call, a missing privilege, a statement timeout, deadlock retries used up,
    a bug): not the items' fault and not the provider's. The jobs go back
    without using an attempt, after a backoff over the faults in a row
    (``consecutive``, this one included); after ``MAX_CONSECUTIVE_WORKER_FAULTS``
    the worker stops, unless the database is merely ``unavailable`` (a restart:
    the worker waits for it, as its main loop does)."""
    message = sanitize(f"{type(exc).__name__}: {exc}")
    stop_reason = None
    if not unavailable and consecutive >= MAX_CONSECUTIVE_WORKER_FAULTS:
        stop_reason = (
            f"worker stopped after {consecutive} faults of its own in a row (database or infrastructure; "
            f"the jobs were given back, no attempt used): {message}"
        )
    delay = backoff.full_jitter(consecutive, base=base, cap=cap, rng=rng)
    return Apply((GiveBack(tuple(j.job_id for j in jobs), delay, WORKER_ERROR, message),), stop_reason=stop_reason)
