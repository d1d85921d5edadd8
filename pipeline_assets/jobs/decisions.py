"""The worker's decisions, as pure functions: no database, no provider, no clock.

``plan_requests`` groups claimed jobs into provider requests; ``decide`` maps a
provider error and the jobs of its request to an outcome; ``check_vectors`` and
``bad_vectors`` judge a successful answer; ``worker_error`` handles a fault of
our own. The transitions they return are the plain values of ``jobs.changes``;
the worker only carries the outcomes out, through ``JobStore.apply``.

Outcomes:

    Apply        apply these transitions (``changes``): a Retry (the attempt
                 counts; failed when used up), a GiveBack (the attempt returned:
                 a throttle, a transient fault charged to the request, an
                 unmatchable answer, a fault of ours) or a Fail (dead letter);
                 with it, count a failure on the shared breaker, pause sending
                 here, or stop the worker after a few faults of our own
    Split        isolate a bad input: send each half on its own (its jobs are
                 marked ``Isolate``: should the split be cut short, each goes
                 alone next time)
    Stop         not the items' fault (auth, configuration, wrong dimension,
                 answers that keep failing to match their inputs): hand back
                 untouched and stop the worker
    ProbeConfig  ask the configuration probe once, then ``decide`` again with
                 its answer as ``config_ok``
    CheckProvider  ask whether the provider answers others (a usable answer
                 since shortly before the request was sent, or else one trivial
                 request, ``"ping"``), then ``decide`` again with ``health``

Who is charged (the evidence decides): only input-specific errors (a 400/413/422
on a single input, a request the provider throttles past the cap) fail an
item; only they isolate inputs. A transient fault (5xx, timeout, dropped
connection, an answer that cannot be matched to its inputs) is judged by the
provider's ``health``: while the provider answers other requests (``ANSWERS``)
it is the request's: the jobs are given back without an attempt and each counts
a fault; once a job's faults reach the evidence threshold (``jobs.evidence``:
more than the provider's own failure rate explains) its requests shrink
(``fault_cap``: a quarter per further fault), and only a job that fails alone
``FREE_FAULTS`` faults past the threshold is charged an attempt. While the
provider answers nobody (``DOWN``) the fault is the provider's alone (the
breaker counts it; nothing is counted on the jobs, no request shrinks). When it
answers nothing usable even to a single trivial input (``UNUSABLE``), that
counts towards ``MAX_UNMATCHED_ANSWERS`` in a row (persisted, shared by every
worker), which stop the worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline_assets.jobs import backoff
from pipeline_assets.jobs.changes import Change, ClaimedJob, Fail, GiveBack, Retry
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, ProviderError, sanitize

# A job's request is halved once for every throttle from this one on: one 429
# is the provider's weather; repeated ones on the same inputs suggest a request
# too large for the account's limits (tokens per minute, a gateway's budget).
THROTTLE_SHRINK_AFTER = 3
# Bounds the halvings (2**62 inputs is beyond any request).
MAX_HALVINGS = 62

# Transient faults (5xx, timeout, dropped connection, unusable answer) a job
# may meet, counted from the evidence threshold ``k`` (``jobs.evidence``: 2 for a
# healthy provider, at most MAX_EVIDENCE_FAULTS = 8), without being charged an
# attempt. From the k-th fault on, each one divides the job's requests by
# 2**FAULT_SHRINK_BITS (a quarter: 256 -> 64 -> 16 -> 4 -> 1, the default batch
# is alone after k + 3); from fault k - 1 + FREE_FAULTS on it travels alone and
# a fault there costs an attempt. So a poison input (one that breaks every
# request holding it) is sent at most MAX_EVIDENCE_FAULTS - 1 + FREE_FAULTS +
# max_attempts times (18 with the defaults; k - 1 + 11 on a provider answering
# everything else: 12 when healthy), and an innocent one is dead-lettered only
# if k - 1 + FREE_FAULTS + max_attempts requests holding it fail in a row while
# the provider answers others.
FREE_FAULTS = 6
FAULT_SHRINK_BITS = 2

# Answers in a row with nothing usable in them, even to one trivial input (a
# wrong count of vectors, a duplicate or missing index), after which the worker
# stops: counted in app.provider_state.unusable_answers (every worker, across
# restarts; any usable answer resets it), so a restarted worker checks first.
MAX_UNMATCHED_ANSWERS = 3

# The provider's health, as the worker judges it after a transient failure.
ANSWERS = "answers"    # it answered other requests usably: the failure points at the request's inputs
DOWN = "down"          # it answers nobody: the failure is the provider's alone
UNUSABLE = "unusable"  # it answers, but nothing usable even to one trivial input
# The error class the worker stops with after MAX_UNMATCHED_ANSWERS answers in a row that cannot
# be matched to their inputs (each one ``providers.base.BAD_RESPONSE``).
TOO_MANY_UNMATCHED_ANSWERS = "unmatched_answers"

# Faults of our own in a row (database, infrastructure, bugs) after which the
# worker stops: a persistent fault (a missing privilege, a full disk) stops it
# with a one-line error instead of cycling the corpus through give-backs.
MAX_CONSECUTIVE_WORKER_FAULTS = 3

# The error class of a give-back for a fault of our own.
WORKER_ERROR = "worker_error"
# The error class of a single input throttled more than ``max_throttles`` times.
THROTTLED_TOO_OFTEN = "throttled_too_often"
# The error class of an answer carrying a NaN or infinite vector.
BAD_VECTOR = "bad_vector"


# -- planning --------------------------------------------------------------------------

def halvings(throttles: int, threshold: int = THROTTLE_SHRINK_AFTER) -> int:
    """How many times a job's requests are halved after ``throttles`` throttles
    (``threshold``: the throttles that are evidence, ``jobs.evidence``)."""
    return min(MAX_HALVINGS, max(0, throttles - threshold + 1))


def fault_level(faults: int, threshold: int = 1) -> int:
    """How many of a job's ``faults`` are evidence against it (0: none yet)."""
    return max(0, faults - threshold + 1)


def fault_cap(faults: int, max_inputs: int, threshold: int = 1) -> int:
    """The most inputs a request holding a job with ``faults`` faults may carry."""
    level = fault_level(faults, threshold)
    if level >= FREE_FAULTS:
        return 1
    return max(1, max_inputs >> (FAULT_SHRINK_BITS * level))


def plan_requests(jobs: Sequence[ClaimedJob], *, max_inputs: int, max_tokens: int, fault_threshold: int = 1,
                  throttle_threshold: int = THROTTLE_SHRINK_AFTER) -> list[list[ClaimedJob]]:
    """Group jobs into requests bounded by inputs and tokens.

    Jobs without text (no current chunk carries their checksum) are left out.
    A job marked ``isolate`` (it was in a batch refused for a bad input whose
    split was cut short) goes alone: if it is the poison, it no longer drags
    innocent neighbours through its retries. A job that met transient faults
    goes in a request of at most ``fault_cap`` inputs (the jobs with the most
    faults go first, so a request's cap is its first job's). Jobs throttled
    repeatedly (from the ``THROTTLE_SHRINK_AFTER``th throttle on) travel only
    with jobs throttled as often, and their requests shrink: at most half of
    that group's inputs, and at most the batch (inputs and tokens) halved once
    per further throttle. So a request the provider never accepts is whittled
    down to the one input it refuses, and the rest of its batch goes through.
    ``fault_threshold`` and ``throttle_threshold`` are the counts from which
    faults and throttles are evidence against a job (``jobs.evidence``): below
    them a job's requests keep the batch size.
    """
    wanted = [j for j in jobs if j.text is not None]
    if all(not j.isolate and j.faults < fault_threshold and j.throttles < throttle_threshold for j in wanted):
        return _fill(wanted, max_inputs, max_tokens, fault_threshold)  # the usual claim: no isolation, no shrinking
    requests = [[j] for j in wanted if j.isolate]
    groups: dict[int, list[ClaimedJob]] = {}  # halvings -> the jobs of that throttle level, in order
    for job in wanted:
        if not job.isolate:
            groups.setdefault(halvings(job.throttles, throttle_threshold), []).append(job)
    for level, group in groups.items():
        inputs_bound, tokens_bound = max_inputs, max_tokens
        if level:
            inputs_bound = max(1, min(max_inputs >> level, -(-len(group) // 2)))
            tokens_bound = max(1, max_tokens >> level)
        requests.extend(_fill(sorted(group, key=lambda j: -j.faults), inputs_bound, tokens_bound, fault_threshold))
    return requests


def _fill(jobs: Sequence[ClaimedJob], max_inputs: int, max_tokens: int,
          fault_threshold: int = 1) -> list[list[ClaimedJob]]:
    """Requests filled in order up to ``max_inputs`` inputs (fewer for a request
    whose first job met faults) and ``max_tokens`` tokens."""
    requests: list[list[ClaimedJob]] = []
    current: list[ClaimedJob] = []
    tokens, bound = 0, max_inputs
    for job in jobs:
        n = job.token_count or 0
        if current and (tokens + n > max_tokens or len(current) >= bound):
            requests.append(current)
            current, tokens = [], 0
        if not current:
            bound = fault_cap(job.faults, max_inputs, fault_threshold)
        current.append(job)
        tokens += n
    if current:
        requests.append(current)
    return requests


def suspect(job: ClaimedJob, threshold: int = 1) -> bool:
    """A job that met ``FREE_FAULTS`` faults past the evidence threshold (``jobs.evidence``),
    worked alone in its process (``jobs.suspects``): its next crash may be its own doing. After
    a crash (``crashed``) every fault counts, as ``rescue_expired`` counts them."""
    return fault_level(job.faults, 1 if job.crashed else threshold) >= FREE_FAULTS


def alone_if_suspect(jobs: Sequence[ClaimedJob],
                     threshold: int = 1) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
    """A claim holding a suspect keeps that job alone (the first such) and hands the others
    back: should it crash its worker, the rescue finds it the only job of the dead process
    and charges it (``rescue_expired``), not its neighbours. Returns (the jobs kept, the jobs
    to hand back)."""
    first = next((j for j in jobs if suspect(j, threshold)), None)
    if first is None or len(jobs) == 1:
        return list(jobs), []
    return [first], [j for j in jobs if j is not first]


def unwanted(jobs: Sequence[ClaimedJob]) -> list[int]:
    """Ids of claimed jobs whose content no current chunk carries any more."""
    return [j.job_id for j in jobs if j.text is None]


# -- outcomes --------------------------------------------------------------------------

@dataclass(frozen=True)
class BreakerFailure:
    """A provider failure, shared by every worker: a throttle pauses them all
    (``pause_only``); a failure while the provider answers nobody counts
    towards tripping the breaker."""
    trip: bool     # trip at once; otherwise count towards the threshold
    floor: float   # the pause lasts at least this long (the provider's Retry-After)
    pause_only: bool = False  # a 429: every worker pauses for the floor, then claims again; nothing counted


@dataclass(frozen=True)
class Apply:
    """Apply ``changes`` (one batch); with them, the provider's and the worker's share."""
    changes: tuple[Change, ...]
    breaker: BreakerFailure | None = None  # count a provider failure (None: not the provider's)
    pause: float = 0.0                     # send nothing more from this worker's held claims for this long
    unusable: bool = False                 # nothing usable even to a trivial input: counts towards stopping
    stop: str | None = None                # too many faults of our own in a row: stop with this one line
    charged: bool = False                  # the failure points at the request's inputs, not at the provider


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
class CheckProvider:
    """Ask whether the provider answers others (``ANSWERS``, ``DOWN``, ``UNUSABLE``), then decide again."""


Outcome = Apply | Split | Stop | ProbeConfig | CheckProvider


# -- deciding --------------------------------------------------------------------------

def retry_delays(jobs: Sequence[ClaimedJob], *, base: float, cap: float, retry_after: float | None = None,
                 rng: random.Random | None = None) -> tuple[float, ...]:
    """Each job's next retry: full jitter over its attempts, never before Retry-After."""
    return tuple(backoff.retry_delay(j.attempts, base=base, cap=cap, retry_after=retry_after, rng=rng)
                 for j in jobs)


def decide(error: ProviderError, jobs: Sequence[ClaimedJob], *, config_ok: bool | None, base: float,
           cap: float, poll_seconds: float, retry_after_cap: float | None = None, max_throttles: int | None = None,
           health: str | None = ANSWERS, unusable_in_a_row: int = 0, fault_threshold: int = 1,
           throttle_threshold: int = THROTTLE_SHRINK_AFTER, rng: random.Random | None = None) -> Outcome:
    """What to do with the jobs of a request the provider refused.

    ``config_ok`` is the configuration probe's answer (None: not asked yet).
    After a 400 the probe is asked first: if a trivial input fails too, the
    "bad input" is the configuration and the worker stops instead of
    dead-lettering the corpus. ``base``/``cap`` bound the backoff,
    ``poll_seconds`` is the shortest local pause after a throttle,
    ``retry_after_cap`` bounds the provider's Retry-After (a proxy's 86400
    would hold every worker for a day), ``max_throttles`` the throttles a
    single input may take before it is dead-lettered (``throttled_too_often``;
    moved up by as many as the throttle evidence threshold is above its
    lowest), ``health`` what the provider does for others (None: not asked
    yet; asked only after a transient failure), ``unusable_in_a_row`` the
    unusable answers to single trivial inputs recorded in a row (every worker),
    ``fault_threshold``/``throttle_threshold`` the evidence thresholds
    (``jobs.evidence``).
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
            return Apply((Fail(ids, THROTTLED_TOO_OFTEN,
                               sanitize(f"throttled {jobs[0].throttles + 1} times, alone in its request "
                                        f"(cap {cap_throttles}): {error.message}")),), breaker, pause)
        return Apply((GiveBack(ids, floor, error.error_class, error.message, throttled=True),), breaker, pause)
    if error.kind == RETRYABLE:
        if health is None:
            return CheckProvider()
        return _transient(error, jobs, floor=floor, base=base, cap=cap, health=health,
                          unusable_in_a_row=unusable_in_a_row, threshold=fault_threshold, rng=rng)
    if error.kind == FATAL:
        return Stop(ids, error)
    raise ValueError(f"unknown provider error kind {error.kind!r}")


def _transient(error: ProviderError, jobs: Sequence[ClaimedJob], *, floor: float, base: float, cap: float,
               health: str, unusable_in_a_row: int, threshold: int, rng: random.Random | None) -> Outcome:
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
                return Stop(ids, ProviderError(FATAL, TOO_MANY_UNMATCHED_ANSWERS, (
                    f"the provider sent {seen} answers in a row that cannot be matched to their inputs, "
                    f"the last to a single trivial input (last: {error.message}); nothing unusable was stored "
                    "and no attempt used: check the endpoint (OPENAI_BASE_URL) or the proxy in front of it"),
                    error.status))
            return Apply((GiveBack(ids, delay, error.error_class, error.message),), breaker, unusable=True)
        return Apply((GiveBack(ids, delay, error.error_class, error.message),), breaker)
    level = max(fault_level(j.faults, threshold) for j in jobs)
    if len(jobs) == 1 and level >= FREE_FAULTS:  # failing alone, again: its attempt counts
        return Apply((Retry(ids, retry_delays(jobs, base=base, cap=cap, retry_after=floor or None, rng=rng),
                            error.error_class, error.message),), charged=True)
    delay = backoff.retry_delay(level, base=base, cap=cap, retry_after=floor or None, rng=rng)
    return Apply((GiveBack(ids, delay, error.error_class, error.message, faulted=True),), charged=True)


def worker_error(exc: BaseException, jobs: Sequence[ClaimedJob], *, consecutive: int, unavailable: bool,
                 base: float, cap: float, rng: random.Random | None = None) -> Apply:
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
    delay = backoff.full_jitter(consecutive, base=base, cap=cap, rng=rng)
    return Apply((GiveBack(tuple(j.job_id for j in jobs), delay, WORKER_ERROR, message),), stop=stop)


def bad_vectors(finite: Sequence[bool], jobs: Sequence[ClaimedJob], *, base: float, cap: float,
                rng: random.Random | None = None) -> Apply | None:
    """After a successful call: a NaN or infinite vector is the provider's
    fault, and the answer names the input it was returned for: those jobs are
    retried (the attempt counts, the breaker counts a failure); the others
    complete. ``finite`` holds, per vector, whether all its components are
    finite."""
    bad = [j for j, ok in zip(jobs, finite) if not ok]
    if not bad:
        return None
    return Apply((Retry(tuple(j.job_id for j in bad), retry_delays(bad, base=base, cap=cap, rng=rng), BAD_VECTOR,
                        f"provider returned a vector with NaN or infinite components for {len(bad)} of "
                        f"{len(jobs)} inputs"),), BreakerFailure(trip=False, floor=0.0))


def without(job_ids: Sequence[int], jobs: Sequence[ClaimedJob], vectors: Sequence) -> tuple[list, list]:
    """The jobs of an answer (and their vectors) other than ``job_ids``."""
    drop = set(job_ids)
    kept = [(j, v) for j, v in zip(jobs, vectors) if j.job_id not in drop]
    return [j for j, _ in kept], [v for _, v in kept]


def check_vectors(dimensions: Sequence[int], jobs: Sequence[ClaimedJob], *, expected: int | None,
                  model_id: str) -> Stop | None:
    """After a successful call: vectors of the wrong dimension mean a
    misconfigured endpoint, not bad items, so stop and touch nothing (every
    answer would be as wrong: no point in a few more). ``dimensions`` holds the
    length of each returned vector; ``expected`` None: the model's dimension is
    not known yet (the first answer records it)."""
    got = set(dimensions)
    if expected is None or got == {expected}:
        return None
    return Stop(tuple(j.job_id for j in jobs),
                ProviderError(FATAL, "dimension_mismatch",
                              f"provider returned {sorted(got)}-dimensional vectors for "
                              f"{model_id}, which has {expected} dimensions"))
