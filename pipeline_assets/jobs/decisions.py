"""The worker's decisions, as pure functions: no database, no provider, no clock.

``plan_requests`` groups claimed jobs into provider requests; ``decide`` maps a
provider error and the jobs of its request to an outcome; ``check_vectors`` and
``bad_vectors`` judge a successful answer; ``worker_error`` handles a fault of
our own. The worker (``jobs.worker``) only carries the outcomes out, through
``JobStore``.

Outcomes:

    Retry        count the attempt, back off (full jitter, at least Retry-After);
                 jobs whose attempts are used up go to ``failed`` instead
    GiveBack     hand back without using the attempt, count a throttle, trip the
                 shared breaker and pause claiming here (throttling is the
                 provider's state)
    Fail         dead-letter at once (the input itself is bad, or a single input
                 was throttled more than the cap allows)
    Split        isolate a bad input: send each half on its own (its jobs are
                 marked ``isolate``: should the split be cut short, each goes
                 alone next time)
    Stop         not the items' fault (auth, configuration, wrong dimension):
                 hand back untouched and stop the worker
    ProbeConfig  ask the configuration probe once, then ``decide`` again with
                 its answer as ``config_ok``
    Release      our own fault (database, infrastructure, a bug): hand back
                 without using the attempt; ``stop`` after a few in a row

Only input-specific errors (a 400/413/422 on a single input, a request the
provider throttles past the cap) fail an item; only they isolate inputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence, Union

from pipeline_assets.jobs import backoff
from pipeline_assets.jobs.transitions import ClaimedJob
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, ProviderError, sanitize


# A job's request is halved once for every throttle from this one on: one 429
# is the provider's weather; repeated ones on the same inputs suggest a request
# too large for the account's limits (tokens per minute, a gateway's budget).
THROTTLE_SHRINK_AFTER = 3
# Bounds the halvings (2**62 inputs is beyond any request).
MAX_HALVINGS = 62

# Faults of our own in a row (database, infrastructure, bugs) after which the
# worker stops: a persistent fault (a missing privilege, a full disk) stops it
# with a one-line error instead of cycling the corpus through give-backs.
MAX_CONSECUTIVE_WORKER_FAULTS = 3

# The error class of a single input throttled more than ``max_throttles`` times.
THROTTLED_TOO_OFTEN = "throttled_too_often"
# The error class of an answer carrying a NaN or infinite vector.
BAD_VECTOR = "bad_vector"


# -- planning --------------------------------------------------------------------------

def halvings(throttles: int) -> int:
    """How many times a job's requests are halved after ``throttles`` throttles."""
    return min(MAX_HALVINGS, max(0, throttles - THROTTLE_SHRINK_AFTER + 1))


def plan_requests(jobs: Sequence[ClaimedJob], *, max_inputs: int, max_tokens: int) -> list[list[ClaimedJob]]:
    """Group jobs into requests bounded by inputs and tokens.

    Jobs without text (no current chunk carries their checksum) are left out.
    A job marked ``isolate`` (it was in a batch refused for a bad input whose
    split was cut short) goes alone: if it is the poison, it no longer drags
    innocent neighbours through its retries. Any other failure (a 5xx, a
    timeout, a crash) isolates nobody. Jobs throttled repeatedly (from the
    ``THROTTLE_SHRINK_AFTER``th throttle on) travel only with jobs throttled as
    often, and their requests shrink: at most half of that group's inputs, and
    at most the batch (inputs and tokens) halved once per further throttle. So a
    request the provider never accepts is whittled down to the one input it
    refuses, and the rest of its batch goes through.
    """
    wanted = [j for j in jobs if j.text is not None]
    if all(not j.isolate and j.throttles < THROTTLE_SHRINK_AFTER for j in wanted):
        return _fill(wanted, max_inputs, max_tokens)  # the usual claim: no isolation, no shrinking
    group: dict[int, int] = {}  # halvings -> inputs of that group in this claim
    for job in wanted:
        level = halvings(job.throttles)
        group[level] = group.get(level, 0) + 1
    requests: list[list[ClaimedJob]] = []
    open_: dict[int, tuple[list[ClaimedJob], int]] = {}  # halvings -> (request being filled, its tokens)
    for job in wanted:
        if job.isolate:
            requests.append([job])
            continue
        level = halvings(job.throttles)
        inputs_bound, tokens_bound = max_inputs, max_tokens
        if level:
            inputs_bound = max(1, min(max_inputs >> level, -(-group[level] // 2)))
            tokens_bound = max(1, max_tokens >> level)
        current, tokens = open_.get(level, ([], 0))
        n = job.token_count or 0
        if current and (tokens + n > tokens_bound or len(current) >= inputs_bound):
            requests.append(current)
            current, tokens = [], 0
        current.append(job)
        open_[level] = (current, tokens + n)
    requests.extend(current for current, _ in open_.values() if current)
    return requests


def _fill(jobs: Sequence[ClaimedJob], max_inputs: int, max_tokens: int) -> list[list[ClaimedJob]]:
    """Requests filled in order up to ``max_inputs`` inputs and ``max_tokens`` tokens."""
    requests: list[list[ClaimedJob]] = []
    current: list[ClaimedJob] = []
    tokens = 0
    for job in jobs:
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
    breaker: BreakerFailure | None = None  # a throttle: trip the breaker all the same
    pause: float = 0.0                     # ... and pause here as after any throttle


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


@dataclass(frozen=True)
class Release:
    """A fault of our own: hand the jobs back without using their attempt."""
    job_ids: tuple[int, ...]
    delay: float                        # not claimable again before this (backoff over the faults in a row)
    error_class: str
    message: str
    stop: str | None = None             # too many in a row: stop the worker with this one-line message


Outcome = Union[Retry, GiveBack, Fail, Split, Stop, ProbeConfig]


# -- deciding --------------------------------------------------------------------------

def retry_delays(jobs: Sequence[ClaimedJob], *, base: float, cap: float, retry_after: float | None = None,
                 rng: random.Random | None = None) -> tuple[float, ...]:
    """Each job's next retry: full jitter over its attempts, never before Retry-After."""
    return tuple(backoff.retry_delay(j.attempts, base=base, cap=cap, retry_after=retry_after, rng=rng)
                 for j in jobs)


def decide(error: ProviderError, jobs: Sequence[ClaimedJob], *, config_ok: bool | None, base: float,
           cap: float, poll_seconds: float, retry_after_cap: float | None = None, max_throttles: int | None = None,
           rng: random.Random | None = None) -> Outcome:
    """What to do with the jobs of a request the provider refused.

    ``config_ok`` is the configuration probe's answer (None: not asked yet).
    After a 400 the probe is asked first: if a trivial input fails too, the
    "bad input" is the configuration and the worker stops instead of
    dead-lettering the corpus. ``base``/``cap`` bound the backoff,
    ``poll_seconds`` is the shortest local pause after a throttle,
    ``retry_after_cap`` bounds the provider's Retry-After (a proxy's 86400
    would hold every worker for a day) and ``max_throttles`` the throttles a
    single input may take before it is dead-lettered (``throttled_too_often``).
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
        return Fail(ids, error.error_class, error.message)
    floor = retry_after or 0.0
    if error.kind == THROTTLED:
        breaker, pause = BreakerFailure(trip=True, floor=floor), max(floor, poll_seconds)
        if len(jobs) == 1 and max_throttles is not None and jobs[0].throttles + 1 > max_throttles:
            return Fail(ids, THROTTLED_TOO_OFTEN,
                        sanitize(f"throttled {jobs[0].throttles + 1} times, alone in its request "
                                 f"(cap {max_throttles}): {error.message}"), breaker=breaker, pause=pause)
        return GiveBack(ids, floor, error.error_class, error.message, breaker, pause=pause)
    if error.kind == RETRYABLE:
        return Retry(ids, retry_delays(jobs, base=base, cap=cap, retry_after=retry_after, rng=rng),
                     error.error_class, error.message, BreakerFailure(trip=False, floor=floor),
                     exhausted=_exhausted(jobs))
    if error.kind == FATAL:
        return Stop(ids, error)
    raise ValueError(f"unknown provider error kind {error.kind!r}")


def worker_error(exc: BaseException, jobs: Sequence[ClaimedJob], *, consecutive: int, unavailable: bool,
                 base: float, cap: float, rng: random.Random | None = None) -> Release:
    """A fault of our own while a claim was held (a database error after the
    call, a missing privilege, a statement timeout, deadlock retries used up,
    a bug): not the items' fault and not the provider's. The jobs go back
    without using an attempt, after a backoff over the faults in a row
    (``consecutive``, this one included); after ``MAX_CONSECUTIVE_WORKER_FAULTS``
    the worker stops, unless the database is merely ``unavailable`` (a restart:
    the worker waits for it, as its main loop does)."""
    message = sanitize(f"{type(exc).__name__}: {exc}")
    stop = None
    if not unavailable and consecutive >= MAX_CONSECUTIVE_WORKER_FAULTS:
        stop = (f"worker stopped after {consecutive} faults of its own in a row (database or infrastructure; "
                f"the jobs were given back, no attempt used): {message}")
    return Release(tuple(j.job_id for j in jobs), backoff.full_jitter(consecutive, base=base, cap=cap, rng=rng),
                   "worker_error", message, stop)


def bad_vectors(finite: Sequence[bool], jobs: Sequence[ClaimedJob], *, base: float, cap: float,
                rng: random.Random | None = None) -> Retry | None:
    """After a successful call: a NaN or infinite vector is the provider's
    fault, not a bug of ours and not (known to be) the input's: the jobs it
    was returned for are retried like after a 5xx (the attempt counts, the
    breaker counts a failure); the others complete. ``finite`` holds, per
    vector, whether all its components are finite."""
    bad = [j for j, ok in zip(jobs, finite) if not ok]
    if not bad:
        return None
    return Retry(tuple(j.job_id for j in bad), retry_delays(bad, base=base, cap=cap, rng=rng), BAD_VECTOR,
                 f"provider returned a vector with NaN or infinite components for {len(bad)} of "
                 f"{len(jobs)} inputs", BreakerFailure(trip=False, floor=0.0), exhausted=_exhausted(bad))


def without(job_ids: Sequence[int], jobs: Sequence[ClaimedJob], vectors: Sequence) -> tuple[list, list]:
    """The jobs of an answer (and their vectors) other than ``job_ids``."""
    kept = [(j, v) for j, v in zip(jobs, vectors) if j.job_id not in set(job_ids)]
    return [j for j, _ in kept], [v for _, v in kept]


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
