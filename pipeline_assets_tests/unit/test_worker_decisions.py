"""The worker's pure decisions, table-driven, without a database or a provider."""

from __future__ import annotations

import random

import pytest

from pipeline_assets.jobqueue import backoff
from pipeline_assets.jobqueue.answer_checks import BAD_VECTOR, bad_vectors, check_vectors, without
from pipeline_assets.jobqueue.changes import ClaimedJob, Fail, GiveBack, Retry
from pipeline_assets.jobqueue.decisions import (
    ANSWERS,
    DOWN,
    MAX_CONSECUTIVE_WORKER_FAULTS,
    MAX_UNMATCHED_ANSWERS,
    THROTTLED_TOO_OFTEN,
    TOO_MANY_UNMATCHED_ANSWERS,
    UNUSABLE,
    decide,
    retry_delays,
    worker_error,
)
from pipeline_assets.jobqueue.outcomes import Apply, BreakerFailure, CheckProvider, ProbeConfig, Split, Stop
from pipeline_assets.jobqueue.request_plan import (
    FREE_FAULTS,
    THROTTLE_SHRINK_AFTER,
    fault_cap,
    halvings,
    plan_requests,
    unwanted,
)
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, ProviderError
from pipeline_assets.providers.base import BAD_RESPONSE
from pipeline_assets_tests.processes import wait_until

BASE, CAP, POLL = 1.0, 60.0, 0.5
RETRY_AFTER_CAP, MAX_THROTTLES = 300.0, 10
SEED = 1234


def job(
    job_id: int,
    *,
    attempts: int = 1,
    max_attempts: int = 5,
    text: str | None = "x",
    tokens: int | None = 10,
    probe: bool = False,
    throttles: int = 0,
    isolate: bool = False,
    faults: int = 0,
) -> ClaimedJob:
    return ClaimedJob(
        job_id, job_id.to_bytes(4, "big"), attempts, max_attempts, text, tokens, probe, throttles, isolate, faults
    )


def ids(requests) -> list[list[int]]:
    return [[j.job_id for j in r] for r in requests]


# -- plan_requests ---------------------------------------------------------------------------

PLANS = [
    pytest.param([], 10, 100, [], id="nothing"),
    pytest.param([job(1), job(2), job(3)], 10, 100, [[1, 2, 3]], id="one request"),
    pytest.param([job(i) for i in range(1, 6)], 2, 1000, [[1, 2], [3, 4], [5]], id="bounded by inputs"),
    pytest.param([job(i) for i in range(1, 6)], 100, 25, [[1, 2], [3, 4], [5]], id="bounded by tokens"),
    pytest.param([job(1, tokens=30), job(2)], 10, 25, [[1], [2]], id="an input over the token bound goes alone"),
    pytest.param([job(1, tokens=None), job(2, tokens=None)], 10, 1, [[1, 2]], id="unknown tokens count as 0"),
    pytest.param([job(1), job(2, text=None), job(3)], 10, 100, [[1, 3]], id="no text: skipped"),
    pytest.param([job(1, text=None)], 10, 100, [], id="only unwanted jobs"),
    pytest.param([job(1), job(2, isolate=True), job(3)], 10, 100, [[2], [1, 3]], id="an isolated job goes alone"),
    pytest.param([job(1, isolate=True), job(2, isolate=True)], 10, 100, [[1], [2]], id="every isolated job alone"),
    pytest.param(
        [job(1), job(2), job(3, isolate=True), job(4)],
        2,
        100,
        [[3], [1, 2], [4]],
        id="an isolated job goes out at once; the open batch keeps filling",
    ),
    # A retry after a 5xx, a timeout or a crash isolates nobody (one 5xx on a
    # 23-input batch stays one request).
    pytest.param(
        [job(i, attempts=2) for i in range(1, 24)],
        256,
        10_000,
        [list(range(1, 24))],
        id="retried jobs (5xx, crash) still travel together",
    ),
    pytest.param(
        [job(1, throttles=1), job(2), job(3, throttles=1)], 10, 100, [[1, 2, 3]], id="one throttle does not shrink"
    ),
    pytest.param(
        [job(i, throttles=THROTTLE_SHRINK_AFTER) for i in range(1, 9)],
        8,
        1000,
        [[1, 2, 3, 4], [5, 6, 7, 8]],
        id="repeated throttles halve the request",
    ),
    pytest.param(
        [job(i, throttles=THROTTLE_SHRINK_AFTER + 1) for i in range(1, 5)],
        8,
        1000,
        [[1, 2], [3, 4]],
        id="each further throttle halves again",
    ),
    pytest.param(
        [job(i, throttles=THROTTLE_SHRINK_AFTER, tokens=10) for i in range(1, 5)],
        100,
        40,
        [[1, 2], [3, 4]],
        id="the token bound halves too",
    ),
    pytest.param(
        [job(1), job(2, throttles=5), job(3), job(4, throttles=5), job(5, throttles=5), job(6, throttles=5)],
        64,
        1000,
        [[1, 3], [2, 4], [5, 6]],
        id="throttled jobs travel only with jobs throttled as often",
    ),
    pytest.param(
        [job(i, throttles=THROTTLE_SHRINK_AFTER) for i in range(1, 14)],
        256,
        100_000,
        [list(range(1, 8)), list(range(8, 14))],
        id="a throttled group far below the batch is halved too",
    ),
    pytest.param([job(1, throttles=40)], 8, 1000, [[1]], id="shrinking stops at one input"),
    # Transient faults shrink a job's requests to a quarter each; FREE_FAULTS of them: alone.
    pytest.param(
        [job(i, faults=1) for i in range(1, 10)],
        16,
        1000,
        [[1, 2, 3, 4], [5, 6, 7, 8], [9]],
        id="one fault: a quarter of the batch",
    ),
    pytest.param(
        [job(1), job(2, faults=2), job(3), job(4), job(5, faults=2)],
        16,
        1000,
        [[2], [5], [1, 3, 4]],
        id="the most faulted go first; their cap bounds their request",
    ),
    pytest.param(
        [job(1), job(2, faults=1), job(3)],
        8,
        1000,
        [[2, 1], [3]],
        id="a faulted job travels with fresh ones, within its cap",
    ),
    pytest.param(
        [job(1, faults=FREE_FAULTS), job(2, faults=FREE_FAULTS)],
        2048,
        10_000,
        [[1], [2]],
        id="past the free faults: alone, whatever the batch",
    ),
]


@pytest.mark.parametrize("jobs, max_inputs, max_tokens, expected", PLANS)
def test_plan_requests(jobs, max_inputs, max_tokens, expected):
    assert ids(plan_requests(jobs, max_inputs=max_inputs, max_tokens=max_tokens)) == expected


def test_plan_requests_keeps_every_wanted_job_exactly_once():
    rng = random.Random(SEED)
    jobs = [
        job(
            i,
            attempts=rng.choice([1, 1, 1, 2]),
            text=rng.choice(["x", "x", None]),
            tokens=rng.randint(1, 50),
            throttles=rng.choice([0, 0, 1, 2, 3, 9]),
            isolate=rng.random() < 0.1,
            faults=rng.choice([0, 0, 0, 1, 2, 5]),
        )
        for i in range(1, 300)
    ]
    requests = plan_requests(jobs, max_inputs=7, max_tokens=120)
    planned = [j.job_id for r in requests for j in r]
    assert sorted(planned) == sorted(j.job_id for j in jobs if j.text is not None)
    for r in requests:
        level = halvings(r[0].throttles)
        assert 1 <= len(r) <= min(max(1, 7 >> level), min(fault_cap(j.faults, 7) for j in r))
        assert len(r) == 1 or (
            sum(j.token_count for j in r) <= max(1, 120 >> level)
            and not any(j.isolate for j in r)
            and {halvings(j.throttles) for j in r} == {level}
        )


def test_unwanted():
    assert unwanted([job(1), job(2, text=None), job(3, text=None)]) == [2, 3]


# -- decide -----------------------------------------------------------------------------------


def err(
    kind: str,
    error_class: str = "e",
    *,
    status: int | None = None,
    retry_after: float | None = None,
    message: str = "boom",
) -> ProviderError:
    return ProviderError(kind, error_class, message, status, retry_after)


def run(
    error: ProviderError,
    jobs,
    *,
    config_ok: bool | None = True,
    seed: int = SEED,
    unusable: int = 0,
    health: str | None = ANSWERS,
    fault_threshold: int = 1,
    throttle_threshold: int = THROTTLE_SHRINK_AFTER,
):
    return decide(
        error,
        jobs,
        config_ok=config_ok,
        base=BASE,
        cap=CAP,
        poll_seconds=POLL,
        retry_after_cap=RETRY_AFTER_CAP,
        max_throttles=MAX_THROTTLES,
        unusable_in_a_row=unusable,
        health=health,
        fault_threshold=fault_threshold,
        throttle_threshold=throttle_threshold,
        rng=random.Random(seed),
    )


def expected_delays(jobs, retry_after=None, seed=SEED):
    rng = random.Random(seed)
    return tuple(backoff.retry_delay(j.attempts, base=BASE, cap=CAP, retry_after=retry_after, rng=rng) for j in jobs)


def fault_delay(level: int, retry_after=None, seed=SEED) -> float:
    return backoff.retry_delay(level, base=BASE, cap=CAP, retry_after=retry_after, rng=random.Random(seed))


def charged(ids, delays, cls, floor=0.0) -> Apply:
    """A transient fault charged to the input (alone, past its free faults, while the provider answers others)."""
    return Apply((Retry(ids, delays, cls, "boom"),), charged=True)


def faulted(ids, delay, cls, floor=0.0) -> Apply:
    """A transient fault charged to the request while the provider answers others: given back, a fault counted."""
    return Apply((GiveBack(ids, delay, cls, "boom", faulted=True),), charged=True)


def throttled(ids, delay, floor, pause) -> Apply:
    return Apply(
        (GiveBack(ids, delay, "rate_limited", "boom", throttled=True),),
        BreakerFailure(trip=False, floor=floor, pause_only=True),
        pause,
    )


def fail(ids, cls, message="boom", **kw) -> Apply:
    return Apply((Fail(ids, cls, message),), **kw)


ONE, TWO, FIVE = [job(1)], [job(1), job(2)], [job(i) for i in range(1, 6)]
ALONE = [job(1, faults=FREE_FAULTS)]  # a job split down to itself

DECISIONS = [
    # RETRYABLE: the provider's (breaker) and the request's, not the inputs': given back without
    # an attempt, a fault counted on each (their next requests shrink); charged only to a job failing alone
    # after its free faults.
    pytest.param(
        err(RETRYABLE, "server_error", status=503),
        FIVE,
        True,
        faulted((1, 2, 3, 4, 5), fault_delay(0), "server_error"),
        id="retryable batch: the request's",
    ),
    pytest.param(
        err(RETRYABLE, "timeout"),
        ONE,
        None,
        faulted((1,), fault_delay(0), "timeout"),
        id="retryable needs no config probe; a first fault alone is free too",
    ),
    pytest.param(
        err(RETRYABLE, "server_error", status=503, retry_after=30.0),
        TWO,
        True,
        faulted((1, 2), 30.0, "server_error", floor=30.0),
        id="retryable: Retry-After is the floor",
    ),
    pytest.param(
        err(RETRYABLE, "server_error"),
        [job(1, attempts=5, max_attempts=5), job(2, faults=2)],
        True,
        faulted((1, 2), fault_delay(2), "server_error"),
        id="retryable batch: even a last attempt is not used; backoff over the most faults",
    ),
    pytest.param(
        err(RETRYABLE, "connection"),
        ALONE,
        True,
        charged((1,), expected_delays(ALONE), "connection"),
        id="retryable alone past its free faults: charged",
    ),
    pytest.param(
        err(RETRYABLE, "connection"),
        [job(1, faults=FREE_FAULTS), job(2)],
        True,
        faulted((1, 2), fault_delay(FREE_FAULTS), "connection"),
        id="retryable: not alone, not charged",
    ),
    pytest.param(
        err(RETRYABLE, BAD_RESPONSE, message="expected 5 vectors, got 4"),
        FIVE,
        True,
        Apply(
            (GiveBack((1, 2, 3, 4, 5), fault_delay(0), BAD_RESPONSE, "expected 5 vectors, got 4", faulted=True),),
            charged=True,
        ),
        id="an unmatchable answer while the provider answers others: the request's, a fault counted",
    ),
    # THROTTLED: the provider's state: give back, trip the breaker, pause here.
    pytest.param(
        err(THROTTLED, "rate_limited", status=429, retry_after=7.0),
        TWO,
        True,
        throttled((1, 2), 7.0, 7.0, 7.0),
        id="throttled with Retry-After",
    ),
    pytest.param(
        err(THROTTLED, "rate_limited", status=429),
        ONE,
        None,
        throttled((1,), 0.0, 0.0, POLL),
        id="throttled without Retry-After pauses one poll",
    ),
    pytest.param(
        err(THROTTLED, "rate_limited", status=429, retry_after=0.1),
        ONE,
        True,
        throttled((1,), 0.1, 0.1, POLL),
        id="throttled: local pause at least one poll",
    ),
    pytest.param(
        err(THROTTLED, "rate_limited", status=429),
        [job(1, attempts=5, max_attempts=5)],
        True,
        throttled((1,), 0.0, 0.0, POLL),
        id="throttled costs no attempt, even the last",
    ),
    # Retry-After is capped (a proxy's 86400 must not hold every worker for a day).
    pytest.param(
        err(THROTTLED, "rate_limited", status=429, retry_after=86400.0),
        ONE,
        True,
        throttled((1,), RETRY_AFTER_CAP, RETRY_AFTER_CAP, RETRY_AFTER_CAP),
        id="throttled: Retry-After capped",
    ),
    pytest.param(
        err(RETRYABLE, "http_503", status=503, retry_after=86400.0),
        ALONE,
        True,
        charged((1,), (RETRY_AFTER_CAP,), "http_503", floor=RETRY_AFTER_CAP),
        id="retryable: Retry-After capped",
    ),
    # Throttles are counted; a lone input throttled past the cap is dead-lettered.
    pytest.param(
        err(THROTTLED, "rate_limited", status=429, retry_after=2.0),
        [job(1, throttles=MAX_THROTTLES - 1)],
        True,
        throttled((1,), 2.0, 2.0, 2.0),
        id="throttled: the cap-th throttle is still given back",
    ),
    pytest.param(
        err(THROTTLED, "rate_limited", status=429, retry_after=2.0),
        [job(1, throttles=MAX_THROTTLES)],
        True,
        fail(
            (1,),
            THROTTLED_TOO_OFTEN,
            f"throttled {MAX_THROTTLES + 1} times, alone in its request (cap {MAX_THROTTLES}): boom",
            breaker=BreakerFailure(trip=False, floor=2.0, pause_only=True),
            pause=2.0,
        ),
        id="throttled past the cap alone: dead-lettered, every worker still pauses",
    ),
    pytest.param(
        err(THROTTLED, "rate_limited", status=429),
        [job(1, throttles=50), job(2, throttles=50)],
        True,
        throttled((1, 2), 0.0, 0.0, POLL),
        id="throttled past the cap in a batch: given back (the next request is smaller)",
    ),
    # TERMINAL: the input is bad, unless the configuration is.
    pytest.param(
        err(TERMINAL, "bad_request", status=400), ONE, None, ProbeConfig(), id="terminal: probe the configuration first"
    ),
    pytest.param(
        err(TERMINAL, "bad_request", status=400),
        FIVE,
        None,
        ProbeConfig(),
        id="terminal batch: probe the configuration first",
    ),
    pytest.param(
        err(TERMINAL, "bad_request", status=400),
        ONE,
        True,
        fail((1,), "bad_request"),
        id="terminal single: dead-lettered",
    ),
    pytest.param(
        err(TERMINAL, "too_large", status=413),
        [job(1, attempts=1, max_attempts=5)],
        True,
        fail((1,), "too_large"),
        id="terminal single: attempts left do not matter",
    ),
    pytest.param(
        err(TERMINAL, "bad_request", status=400), TWO, True, Split(((job(1),), (job(2),))), id="terminal pair: split"
    ),
    pytest.param(
        err(TERMINAL, "bad_request", status=400),
        FIVE,
        True,
        Split((tuple(FIVE[:2]), tuple(FIVE[2:]))),
        id="terminal batch: split in halves",
    ),
    pytest.param(
        err(TERMINAL, "bad_request", status=400, message="dimensions not supported"),
        FIVE,
        False,
        Stop((1, 2, 3, 4, 5), ProviderError(FATAL, "config_rejected", "dimensions not supported", 400)),
        id="terminal when the config probe fails: stop",
    ),
    pytest.param(
        err(TERMINAL, "bad_request", status=400),
        ONE,
        False,
        Stop((1,), ProviderError(FATAL, "config_rejected", "boom", 400)),
        id="terminal single when the config probe fails: stop",
    ),
    # FATAL: auth and configuration: hand back untouched and stop.
    pytest.param(
        err(FATAL, "auth", status=401),
        FIVE,
        None,
        Stop((1, 2, 3, 4, 5), ProviderError(FATAL, "auth", "boom", 401)),
        id="fatal: 401",
    ),
    pytest.param(
        err(FATAL, "model_not_found", status=404),
        [job(1, attempts=5, max_attempts=5)],
        True,
        Stop((1,), ProviderError(FATAL, "model_not_found", "boom", 404)),
        id="fatal: exhausted attempts are not touched",
    ),
]


def same_error(a: ProviderError, b: ProviderError) -> bool:
    return (a.kind, a.error_class, a.message, a.status, a.retry_after) == (
        b.kind,
        b.error_class,
        b.message,
        b.status,
        b.retry_after,
    )


@pytest.mark.parametrize("error, jobs, config_ok, expected", DECISIONS)
def test_decide(error, jobs, config_ok, expected):
    got = run(error, jobs, config_ok=config_ok)
    assert type(got) is type(expected)
    if isinstance(expected, Stop):
        assert got.job_ids == expected.job_ids
        assert same_error(got.error, expected.error)
    else:
        assert got == expected


def test_decide_is_deterministic_with_a_seeded_rng():
    for error, jobs in (
        (err(RETRYABLE, "timeout"), [job(1, attempts=4, faults=FREE_FAULTS)]),
        (err(RETRYABLE, "timeout"), [job(1, faults=2), job(2)]),
    ):
        first, again = run(error, jobs, seed=7), run(error, jobs, seed=7)
        assert first == again
        assert run(error, jobs, seed=8) != first


@pytest.mark.parametrize("attempts", [1, 2, 3, 6, 10])
def test_retry_delays_are_full_jitter_bounded_by_the_attempt(attempts):
    jobs = [job(i, attempts=attempts, max_attempts=20) for i in range(200)]
    delays = retry_delays(jobs, base=BASE, cap=CAP, rng=random.Random(SEED))
    bound = min(CAP, BASE * 2**attempts)
    assert all(0.0 <= d <= bound for d in delays)
    assert max(delays) > 0.8 * bound


def test_retry_after_above_the_backoff_cap_still_wins_up_to_its_own_cap():
    out = run(err(RETRYABLE, "server_error", retry_after=200.0), [job(1, attempts=10, faults=FREE_FAULTS)])
    assert out.changes[0].delays == (200.0,)
    out = run(err(RETRYABLE, "server_error", retry_after=600.0), [job(1, attempts=10, faults=FREE_FAULTS)])
    assert out.changes[0].delays == (RETRY_AFTER_CAP,)
    out = run(err(RETRYABLE, "server_error", retry_after=600.0), TWO)
    assert out.changes[0].delay == RETRY_AFTER_CAP


def test_a_few_unusable_answers_in_a_row_even_to_a_trivial_input_stop_the_worker():
    error = err(RETRYABLE, BAD_RESPONSE, message="expected 8 vectors, got 7")
    for seen in range(MAX_UNMATCHED_ANSWERS - 1):
        out = run(error, FIVE, unusable=seen, health=UNUSABLE)
        assert isinstance(out, Apply) and out.unusable and out.changes[0].faulted is False and not out.charged
    out = run(error, [job(1, attempts=5, max_attempts=5), job(2)], unusable=MAX_UNMATCHED_ANSWERS - 1, health=UNUSABLE)
    assert isinstance(out, Stop) and out.job_ids == (1, 2)  # handed back untouched
    assert out.error.kind == FATAL and out.error.error_class == TOO_MANY_UNMATCHED_ANSWERS
    assert f"{MAX_UNMATCHED_ANSWERS} answers in a row" in out.error.message
    assert "expected 8 vectors, got 7" in out.error.message and "\n" not in out.error.message


def test_a_transient_failure_asks_whether_the_provider_answers_others_first():
    assert run(err(RETRYABLE, "server_error", status=500), FIVE, health=None) == CheckProvider()
    assert isinstance(run(err(THROTTLED, "rate_limited", status=429), FIVE, health=None), Apply)


@pytest.mark.parametrize(
    "error", [err(RETRYABLE, "server_error", status=503), err(RETRYABLE, "timeout"), err(RETRYABLE, BAD_RESPONSE)]
)
def test_while_the_provider_answers_nobody_a_failure_is_its_alone(error):
    """An outage of any length counts nothing on the jobs (no request shrinks, no attempt is
    used, however many faults they met) and comes back after a short spread-out delay."""
    for jobs in (FIVE, [job(1, attempts=5, max_attempts=5, faults=40)]):
        out = run(error, jobs, health=DOWN)
        assert isinstance(out, Apply) and not out.charged and not out.unusable
        (change,) = out.changes
        assert isinstance(change, GiveBack) and not change.faulted and 0.0 <= change.delay <= BASE
        assert out.breaker == BreakerFailure(trip=False, floor=0.0)


def test_faults_below_the_evidence_threshold_keep_the_batch_and_are_not_charged():
    """Random provider-wide faults: below the threshold (jobqueue.evidence) nothing shrinks;
    from it on a quarter per fault; alone, FREE_FAULTS past it, an attempt is charged."""
    k = 8
    assert fault_cap(k - 1, 256, k) == 256 and fault_cap(k, 256, k) == 64 and fault_cap(k + 3, 256, k) == 1
    assert ids(
        plan_requests([job(i, faults=k - 1) for i in range(1, 11)], max_inputs=256, max_tokens=10**6, fault_threshold=k)
    ) == [list(range(1, 11))]
    alone = [job(1, faults=k - 2 + FREE_FAULTS)]
    out = run(err(RETRYABLE, "timeout"), alone, fault_threshold=k)
    assert isinstance(out.changes[0], GiveBack) and out.changes[0].faulted
    out = run(err(RETRYABLE, "timeout"), [job(1, faults=k - 1 + FREE_FAULTS)], fault_threshold=k)
    assert isinstance(out.changes[0], Retry)


def test_throttles_below_the_evidence_threshold_keep_the_batch():
    k = 7
    assert halvings(k - 1, k) == 0 and halvings(k, k) == 1
    assert ids(
        plan_requests(
            [job(i, throttles=k - 1) for i in range(1, 11)], max_inputs=256, max_tokens=10**6, throttle_threshold=k
        )
    ) == [list(range(1, 11))]
    # The cap on a lone input's throttles moves up with the threshold.
    lone = [job(1, throttles=MAX_THROTTLES + k - THROTTLE_SHRINK_AFTER - 1)]
    assert isinstance(run(err(THROTTLED, "rate_limited", status=429), lone, throttle_threshold=k).changes[0], GiveBack)


def _simulate(fails, *, jobs: int, batch: int, max_attempts: int = 5, rng: random.Random) -> tuple[dict, dict]:
    """The worker's loop over the decisions for transient faults: ``fails(request, rng)`` says whether
    a request fails. Returns (sends per job, dead-lettered job ids -> attempts)."""
    queue = {i: job(i, attempts=0, max_attempts=max_attempts) for i in range(1, jobs + 1)}
    sends = {i: 0 for i in queue}
    dead: dict[int, int] = {}
    while queue:
        claimed = [j._replace(attempts=j.attempts + 1) for j in queue.values()]
        for request in plan_requests(claimed, max_inputs=batch, max_tokens=10**9):
            for j in request:
                sends[j.job_id] += 1
            if not fails(request, rng):
                for j in request:
                    del queue[j.job_id]
                continue
            out = run(err(RETRYABLE, "connection"), request, seed=rng.randrange(10**6))
            (change,) = out.changes
            for j in request:
                if isinstance(change, GiveBack):  # no attempt used; a fault counted
                    queue[j.job_id] = j._replace(attempts=j.attempts - 1, faults=j.faults + 1)
                elif j.attempts >= j.max_attempts:  # a Retry, attempts used up: failed
                    dead[j.job_id] = j.attempts
                    del queue[j.job_id]
                else:
                    queue[j.job_id] = j
    return sends, dead


def test_a_poison_input_is_dead_lettered_alone_with_bounded_sends():
    """An input that breaks every request holding it (a dropped connection each time) ends in the
    dead-letter queue alone, after at most FREE_FAULTS + max_attempts sends; nothing else is."""
    poison = 37
    sends, dead = _simulate(
        lambda r, _: any(j.job_id == poison for j in r), jobs=300, batch=256, rng=random.Random(SEED)
    )
    assert dead == {poison: 5}
    assert sends[poison] <= FREE_FAULTS + 5 <= 12
    assert max(n for i, n in sends.items() if i != poison) <= FREE_FAULTS + 1


def test_random_transient_faults_dead_letter_nobody():
    """30% of requests fail (dropped answers): innocent inputs are given back, not charged,
    until they have been split down to themselves; 200 runs of 60 jobs lose none."""
    rng = random.Random(SEED)
    for _ in range(200):
        _, dead = _simulate(lambda r, g: g.random() < 0.3, jobs=60, batch=256, rng=rng)
        assert dead == {}


def test_decide_rejects_an_unknown_kind():
    with pytest.raises(ValueError):
        run(err("mystery"), ONE)


def test_config_probe_then_split_isolates_the_bad_input():
    """The worker's loop over the decisions: probe once, then halve until the bad input is alone."""
    bad = 4
    jobs = [job(i) for i in range(1, 8)]
    config_ok: bool | None = None
    probes, failed, pending = 0, [], [jobs]
    while pending:
        request = pending.pop(0)
        if bad not in [j.job_id for j in request]:
            continue  # the provider accepts it
        outcome = run(err(TERMINAL, "bad_request", status=400), request, config_ok=config_ok)
        if isinstance(outcome, ProbeConfig):
            probes += 1
            config_ok = True
            pending.insert(0, request)
        elif isinstance(outcome, Split):
            pending[:0] = [list(h) for h in outcome.halves]
        elif isinstance(outcome, Apply) and isinstance(outcome.changes[0], Fail):
            failed.extend(outcome.changes[0].job_ids)
    assert probes == 1 and failed == [bad]


# -- worker errors and the answer's dimension ------------------------------------------------------


def test_worker_error_gives_back_without_an_attempt_and_without_blaming_the_provider():
    jobs = [job(1), job(2, attempts=5, max_attempts=5)]
    out = worker_error(
        RuntimeError("permission denied sk-abcdefghijklmnop"),
        jobs,
        consecutive=1,
        unavailable=False,
        base=BASE,
        cap=CAP,
        rng=random.Random(SEED),
    )
    (back,) = out.changes  # no attempt used: even the job on its last attempt is not failed
    assert isinstance(back, GiveBack) and not back.faulted and not back.throttled
    assert back.job_ids == (1, 2)
    assert back.delay == random.Random(SEED).uniform(0.0, min(CAP, BASE * 2))
    assert back.error_class == "worker_error"
    assert back.message.startswith("RuntimeError: permission denied") and "sk-abcdefghijklmnop" not in back.message
    assert out.stop_reason is None and out.breaker is None


@pytest.mark.parametrize(
    "consecutive, unavailable, stops",
    [
        (1, False, False),
        (MAX_CONSECUTIVE_WORKER_FAULTS - 1, False, False),
        (MAX_CONSECUTIVE_WORKER_FAULTS, False, True),
        (MAX_CONSECUTIVE_WORKER_FAULTS + 5, False, True),
        (MAX_CONSECUTIVE_WORKER_FAULTS + 5, True, False),  # an unreachable database is waited for
    ],
)
def test_worker_error_stops_after_a_few_in_a_row(consecutive, unavailable, stops):
    out = worker_error(
        ValueError("boom\nsecond line"),
        [job(1)],
        consecutive=consecutive,
        unavailable=unavailable,
        base=BASE,
        cap=CAP,
        rng=random.Random(SEED),
    )
    assert (out.stop_reason is not None) == stops
    if stops:
        assert "\n" not in out.stop_reason and out.stop_reason.endswith("ValueError: boom second line")
        assert f"after {consecutive} faults" in out.stop_reason
    assert 0.0 <= out.changes[0].delay <= min(CAP, BASE * 2**consecutive)


def test_bad_vectors_retry_only_the_non_finite_ones_as_a_provider_fault():
    jobs = [job(1), job(2, attempts=5, max_attempts=5), job(3)]
    assert bad_vectors([True, True, True], jobs, base=BASE, cap=CAP) is None
    out = bad_vectors([True, False, False], jobs, base=BASE, cap=CAP, rng=random.Random(SEED))
    (retry,) = out.changes  # the answer names the inputs: their attempt counts
    assert isinstance(retry, Retry) and retry.job_ids == (2, 3)
    assert retry.error_class == BAD_VECTOR
    assert out.breaker == BreakerFailure(trip=False, floor=0.0)  # the provider's fault, counted by the breaker
    assert retry.delays == expected_delays(jobs[1:])
    kept, vectors = without(retry.job_ids, jobs, ["v1", "v2", "v3"])
    assert [j.job_id for j in kept] == [1] and vectors == ["v1"]


VECTORS = [
    pytest.param([3, 3], None, None, id="unknown dimension: the first answer is recorded"),
    pytest.param([3, 3], 3, None, id="right dimension"),
    pytest.param([4, 4], 3, "[4]-dimensional vectors for m, which has 3 dimensions", id="wrong dimension"),
    pytest.param([3, 4], 3, "[3, 4]-dimensional vectors for m, which has 3 dimensions", id="mixed dimensions"),
    pytest.param([], 3, "[]-dimensional vectors for m, which has 3 dimensions", id="no vectors"),
]


@pytest.mark.parametrize("dimensions, expected, message", VECTORS)
def test_check_vectors(dimensions, expected, message):
    jobs = [job(1), job(2)]
    out = check_vectors(dimensions, jobs, expected=expected, model_id="m")
    if message is None:
        assert out is None
    else:
        assert isinstance(out, Stop) and out.job_ids == (1, 2)
        assert out.error.kind == FATAL and out.error.error_class == "dimension_mismatch"
        assert message in out.error.message


# -- a crash suspect is claimed alone ----------------------------------------------------------------


def test_a_claim_holding_a_crash_suspect_keeps_it_alone():
    """A job with FREE_FAULTS faults travels alone in its claim: should it crash the worker,
    the rescue finds it alone and charges it, not its neighbours."""
    from pipeline_assets.jobqueue.decisions import alone_if_suspect
    from pipeline_assets.jobqueue.request_plan import FREE_FAULTS

    plain = [job(1), job(2, faults=FREE_FAULTS - 1)]
    assert alone_if_suspect(plain) == (plain, [])
    suspect = job(3, faults=FREE_FAULTS)
    assert alone_if_suspect([suspect]) == ([suspect], [])
    kept, back = alone_if_suspect([job(1), suspect, job(4, faults=FREE_FAULTS + 2)])
    assert [j.job_id for j in kept] == [3] and [j.job_id for j in back] == [1, 4]


def test_a_suspects_claim_runs_alone_in_its_process():
    """SuspectGate: the suspect's claim starts once the claims already held end; new claims
    wait until it is over; a stop lets everyone through."""
    import threading

    from pipeline_assets.jobqueue.suspects import SuspectGate

    gate, stop = SuspectGate(), threading.Event()
    events: list[str] = []
    gate.enter(stop)  # another thread's claim is running
    suspect_entered = threading.Event()

    def suspect() -> None:
        gate.enter(stop)
        suspect_entered.set()
        with gate.alone(stop):
            events.append("suspect runs")
            newcomer = threading.Thread(target=late_claim)
            newcomer.start()
            newcomer.join(0.3)  # it cannot start while the suspect runs
            events.append("suspect ends")
        gate.leave()
        newcomer.join(10)

    def late_claim() -> None:
        gate.enter(stop)
        events.append("late claim runs")
        gate.leave()

    t = threading.Thread(target=suspect)
    t.start()
    assert suspect_entered.wait(10)
    t.join(0.3)
    assert events == []  # waiting for the claim already held
    gate.leave()  # ... which ends
    t.join(10)
    assert events == ["suspect runs", "suspect ends", "late claim runs"]
    # A stop lets a waiting suspect through (what runs then hands its jobs back).
    gate.enter(stop)  # another thread's claim, never ending
    gate.enter(stop)
    stop.set()
    with gate.alone(stop):
        events.append("stopping")
    assert events[-1] == "stopping"


def test_a_process_holds_one_suspect_at_a_time():
    """SuspectGate: while one suspect's claim waits for its turn (or runs alone), another
    thread's suspect claim is turned away at once, not held waiting under its lease: held, it
    would be rescued beside the first should that one crash the process, and the first would
    not be the only job of its dead process (it would get a fault, not be charged)."""
    import threading

    from pipeline_assets.jobqueue.suspects import SuspectGate

    gate, stop = SuspectGate(), threading.Event()
    gate.enter(stop)  # a third thread's claim is running
    gate.enter(stop)  # the thread that claims the second suspect entered meanwhile
    first_waits, first_done = threading.Event(), threading.Event()
    turns: list[object] = []

    def first_suspect() -> None:
        gate.enter(stop)
        first_waits.set()
        with gate.alone(stop) as turn:
            turns.append(("first", turn))
        gate.leave()
        first_done.set()

    t = threading.Thread(target=first_suspect, daemon=True)
    t.start()
    assert first_waits.wait(10)
    wait_until(lambda: gate._waiting == 1, timeout=10, what="the first suspect waiting for its turn")

    def second_suspect() -> None:
        with gate.alone(stop) as turn:
            turns.append(("second", turn))

    second = threading.Thread(target=second_suspect, daemon=True)
    second.start()
    second.join(10)
    alive = second.is_alive()
    if alive:
        stop.set()  # it waits (the defect): let it through, then fail
    assert not alive and turns == [("second", False)]  # turned away, not waiting
    gate.leave()  # the turned-away thread leaves (it handed its job back)
    gate.leave()  # the third thread's claim ends: the first runs alone
    assert first_done.wait(10)
    t.join(10)
    assert turns == [("second", False), ("first", True)]
    # Once no suspect waits or runs, the next one gets its turn.
    gate.enter(stop)
    with gate.alone(stop) as turn:
        assert turn is True
    gate.leave()
