"""The worker's decisions, as pure functions: no database, no provider, no clock.

``plan_requests`` groups claimed jobs into provider requests; ``decide`` maps a
provider error and the jobs of its request to an outcome; ``check_vectors``
judges a successful answer; ``worker_error`` handles a fault of our own. The
worker (``jobs.worker``) only carries the outcomes out, through ``JobStore``.

Outcomes:

    Retry        count the attempt, back off (full jitter, at least Retry-After);
                 jobs whose attempts are used up go to ``failed`` instead
    GiveBack     hand back without using the attempt, trip the shared breaker
                 and pause claiming here (throttling is the provider's state)
    Fail         dead-letter at once (the input itself is bad)
    Split        isolate a bad input: send each half on its own
    Stop         not the items' fault (auth, configuration, wrong dimension):
                 hand back untouched and stop the worker
    ProbeConfig  ask the configuration probe once, then ``decide`` again with
                 its answer as ``config_ok``
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence, Union

from pipeline_assets.jobs import backoff
from pipeline_assets.jobs.transitions import ClaimedJob
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, ProviderError, sanitize


# -- planning --------------------------------------------------------------------------

def plan_requests(jobs: Sequence[ClaimedJob], *, max_inputs: int, max_tokens: int) -> list[list[ClaimedJob]]:
    """Group jobs into requests bounded by inputs and tokens.

    Jobs without text (no current chunk carries their checksum) are left out;
    a job that failed before (attempts > 1) goes alone: if it is the poison, it
    no longer drags innocent neighbours through its retries.
    """
    requests: list[list[ClaimedJob]] = []
    current: list[ClaimedJob] = []
    tokens = 0
    for job in jobs:
        if job.text is None:
            continue
        if job.attempts > 1:
            requests.append([job])
            continue
        n = job.token_count or 0
        if current and (tokens + n > max_tokens or len(current) >= max_inputs):
            requests.append(current)
            current, tokens = [], 0
        current.append(job)
        tokens += n
    if current:
        requests.append(current)
    return requests


def unwanted(jobs: Sequence[ClaimedJob]) -> list[int]:
    """Ids of claimed jobs whose content no current chunk carries any more."""
    return [j.job_id for j in jobs if j.text is None]


# -- outcomes --------------------------------------------------------------------------

@dataclass(frozen=True)
class BreakerFailure:
    """A provider failure counted by the breaker shared by every worker."""
    trip: bool     # trip at once (429); otherwise count towards the threshold
    floor: float   # the pause lasts at least this long (the provider's Retry-After)


@dataclass(frozen=True)
class Retry:
    job_ids: tuple[int, ...]
    delays: tuple[float, ...]           # per job, same order
    error_class: str
    message: str
    breaker: BreakerFailure | None      # None: our own fault, not the provider's
    exhausted: tuple[int, ...] = ()     # attempts used up: these go to failed (the guarded UPDATE decides)


@dataclass(frozen=True)
class GiveBack:
    job_ids: tuple[int, ...]
    delay: float                        # not claimable again before this
    error_class: str
    message: str
    breaker: BreakerFailure
    pause: float                        # send nothing more from this worker's held claims for this long


@dataclass(frozen=True)
class Fail:
    job_ids: tuple[int, ...]
    error_class: str
    message: str


@dataclass(frozen=True)
class Split:
    halves: tuple[tuple[ClaimedJob, ...], tuple[ClaimedJob, ...]]


@dataclass(frozen=True)
class Stop:
    job_ids: tuple[int, ...]            # handed back untouched
    error: ProviderError                # kind FATAL: why the worker stops


@dataclass(frozen=True)
class ProbeConfig:
    """Ask the configuration probe (once per worker), then decide again."""


Outcome = Union[Retry, GiveBack, Fail, Split, Stop, ProbeConfig]


# -- deciding --------------------------------------------------------------------------

def retry_delays(jobs: Sequence[ClaimedJob], *, base: float, cap: float, retry_after: float | None = None,
                 rng: random.Random | None = None) -> tuple[float, ...]:
    """Each job's next retry: full jitter over its attempts, never before Retry-After."""
    return tuple(backoff.retry_delay(j.attempts, base=base, cap=cap, retry_after=retry_after, rng=rng)
                 for j in jobs)


def decide(error: ProviderError, jobs: Sequence[ClaimedJob], *, config_ok: bool | None, base: float,
           cap: float, poll_seconds: float, rng: random.Random | None = None) -> Outcome:
    """What to do with the jobs of a request the provider refused.

    ``config_ok`` is the configuration probe's answer (None: not asked yet).
    After a 400 the probe is asked first: if a trivial input fails too, the
    "bad input" is the configuration and the worker stops instead of
    dead-lettering the corpus. ``base``/``cap`` bound the backoff,
    ``poll_seconds`` is the shortest local pause after a throttle.
    """
    ids = tuple(j.job_id for j in jobs)
    if error.kind == TERMINAL:
        if config_ok is None:
            return ProbeConfig()
        if not config_ok:
            return Stop(ids, ProviderError(FATAL, "config_rejected", error.message, error.status))
        if len(jobs) > 1:
            mid = len(jobs) // 2
            return Split((tuple(jobs[:mid]), tuple(jobs[mid:])))
        return Fail(ids, error.error_class, error.message)
    floor = error.retry_after or 0.0
    if error.kind == THROTTLED:
        return GiveBack(ids, floor, error.error_class, error.message, BreakerFailure(trip=True, floor=floor),
                        pause=max(floor, poll_seconds))
    if error.kind == RETRYABLE:
        return Retry(ids, retry_delays(jobs, base=base, cap=cap, retry_after=error.retry_after, rng=rng),
                     error.error_class, error.message, BreakerFailure(trip=False, floor=floor),
                     exhausted=_exhausted(jobs))
    if error.kind == FATAL:
        return Stop(ids, error)
    raise ValueError(f"unknown provider error kind {error.kind!r}")


def worker_error(exc: BaseException, jobs: Sequence[ClaimedJob], *, base: float, cap: float,
                 rng: random.Random | None = None) -> Retry:
    """A bug or a database hiccup while a claim was held: not the items' fault
    and not the provider's; count the attempt and let the backoff retry them."""
    return Retry(tuple(j.job_id for j in jobs), retry_delays(jobs, base=base, cap=cap, rng=rng),
                 "worker_error", sanitize(f"{type(exc).__name__}: {exc}"), breaker=None,
                 exhausted=_exhausted(jobs))


def check_vectors(dimensions: Sequence[int], jobs: Sequence[ClaimedJob], *, expected: int | None,
                  model_id: str) -> Stop | None:
    """After a successful call: vectors of the wrong dimension mean a
    misconfigured endpoint, not bad items, so stop and touch nothing.
    ``dimensions`` holds the length of each returned vector; ``expected`` None:
    the model's dimension is not known yet (the first answer records it)."""
    got = set(dimensions)
    if expected is None or got == {expected}:
        return None
    return Stop(tuple(j.job_id for j in jobs),
                ProviderError(FATAL, "dimension_mismatch",
                              f"provider returned {sorted(got)}-dimensional vectors for "
                              f"{model_id}, which has {expected} dimensions"))


def _exhausted(jobs: Sequence[ClaimedJob]) -> tuple[int, ...]:
    return tuple(j.job_id for j in jobs if j.attempts >= j.max_attempts)
