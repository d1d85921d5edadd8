"""The worker's pure decisions, table-driven, without a database or a provider."""

from __future__ import annotations

import random

import pytest

from pipeline_assets.jobs import backoff
from pipeline_assets.jobs.decisions import (BreakerFailure, Fail, GiveBack, ProbeConfig, Retry, Split, Stop,
                                            check_vectors, decide, plan_requests, retry_delays, unwanted,
                                            worker_error)
from pipeline_assets.jobs.transitions import ClaimedJob
from pipeline_assets.providers import FATAL, RETRYABLE, TERMINAL, THROTTLED, ProviderError

BASE, CAP, POLL = 1.0, 60.0, 0.5
SEED = 1234


def job(job_id: int, *, attempts: int = 1, max_attempts: int = 5, text: str | None = "x",
        tokens: int | None = 10, probe: bool = False) -> ClaimedJob:
    return ClaimedJob(job_id, job_id.to_bytes(4, "big"), attempts, max_attempts, text, tokens, probe)


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
    pytest.param([job(1), job(2, attempts=2), job(3)], 10, 100, [[2], [1, 3]], id="a retried job goes alone"),
    pytest.param([job(1, attempts=3), job(2, attempts=2)], 10, 100, [[1], [2]], id="every retried job alone"),
    pytest.param([job(1), job(2), job(3, attempts=2), job(4)], 2, 100, [[3], [1, 2], [4]],
                 id="a retried job goes out at once; the open batch keeps filling"),
]


@pytest.mark.parametrize("jobs, max_inputs, max_tokens, expected", PLANS)
def test_plan_requests(jobs, max_inputs, max_tokens, expected):
    assert ids(plan_requests(jobs, max_inputs=max_inputs, max_tokens=max_tokens)) == expected


def test_plan_requests_keeps_every_wanted_job_exactly_once():
    rng = random.Random(SEED)
    jobs = [job(i, attempts=rng.choice([1, 1, 1, 2]), text=rng.choice(["x", "x", None]),
                tokens=rng.randint(1, 50)) for i in range(1, 300)]
    requests = plan_requests(jobs, max_inputs=7, max_tokens=120)
    planned = [j.job_id for r in requests for j in r]
    assert sorted(planned) == sorted(j.job_id for j in jobs if j.text is not None)
    for r in requests:
        assert 1 <= len(r) <= 7
        assert len(r) == 1 or (sum(j.token_count for j in r) <= 120 and all(j.attempts == 1 for j in r))


def test_unwanted():
    assert unwanted([job(1), job(2, text=None), job(3, text=None)]) == [2, 3]


# -- decide -----------------------------------------------------------------------------------

def err(kind: str, error_class: str = "e", *, status: int | None = None, retry_after: float | None = None,
        message: str = "boom") -> ProviderError:
    return ProviderError(kind, error_class, message, status, retry_after)


def run(error: ProviderError, jobs, *, config_ok: bool | None = True, seed: int = SEED):
    return decide(error, jobs, config_ok=config_ok, base=BASE, cap=CAP, poll_seconds=POLL,
                  rng=random.Random(seed))


def expected_delays(jobs, retry_after=None, seed=SEED):
    rng = random.Random(seed)
    return tuple(backoff.retry_delay(j.attempts, base=BASE, cap=CAP, retry_after=retry_after, rng=rng)
                 for j in jobs)


ONE, TWO, FIVE = [job(1)], [job(1), job(2)], [job(i) for i in range(1, 6)]

DECISIONS = [
    # RETRYABLE: timeouts, connection errors, 408/409/5xx: count the attempt, back off, count for the breaker.
    pytest.param(err(RETRYABLE, "server_error", status=503), FIVE, True,
                 Retry((1, 2, 3, 4, 5), expected_delays(FIVE), "server_error", "boom",
                       BreakerFailure(trip=False, floor=0.0)), id="retryable"),
    pytest.param(err(RETRYABLE, "timeout"), ONE, None,
                 Retry((1,), expected_delays(ONE), "timeout", "boom", BreakerFailure(trip=False, floor=0.0)),
                 id="retryable needs no config probe"),
    pytest.param(err(RETRYABLE, "server_error", status=503, retry_after=30.0), TWO, True,
                 Retry((1, 2), (30.0, 30.0), "server_error", "boom", BreakerFailure(trip=False, floor=30.0)),
                 id="retryable: Retry-After is the floor"),
    pytest.param(err(RETRYABLE, "server_error"), [job(1, attempts=5, max_attempts=5), job(2, attempts=2)], True,
                 Retry((1, 2), expected_delays([job(1, attempts=5), job(2, attempts=2)]), "server_error", "boom",
                       BreakerFailure(trip=False, floor=0.0), exhausted=(1,)),
                 id="retryable: attempts exhausted"),
    # THROTTLED: the provider's state: give back, trip the breaker, pause here.
    pytest.param(err(THROTTLED, "rate_limited", status=429, retry_after=7.0), TWO, True,
                 GiveBack((1, 2), 7.0, "rate_limited", "boom", BreakerFailure(trip=True, floor=7.0), pause=7.0),
                 id="throttled with Retry-After"),
    pytest.param(err(THROTTLED, "rate_limited", status=429), ONE, None,
                 GiveBack((1,), 0.0, "rate_limited", "boom", BreakerFailure(trip=True, floor=0.0), pause=POLL),
                 id="throttled without Retry-After pauses one poll"),
    pytest.param(err(THROTTLED, "rate_limited", status=429, retry_after=0.1), ONE, True,
                 GiveBack((1,), 0.1, "rate_limited", "boom", BreakerFailure(trip=True, floor=0.1), pause=POLL),
                 id="throttled: local pause at least one poll"),
    pytest.param(err(THROTTLED, "rate_limited", status=429), [job(1, attempts=5, max_attempts=5)], True,
                 GiveBack((1,), 0.0, "rate_limited", "boom", BreakerFailure(trip=True, floor=0.0), pause=POLL),
                 id="throttled costs no attempt, even the last"),
    # TERMINAL: the input is bad, unless the configuration is.
    pytest.param(err(TERMINAL, "bad_request", status=400), ONE, None, ProbeConfig(),
                 id="terminal: probe the configuration first"),
    pytest.param(err(TERMINAL, "bad_request", status=400), FIVE, None, ProbeConfig(),
                 id="terminal batch: probe the configuration first"),
    pytest.param(err(TERMINAL, "bad_request", status=400), ONE, True, Fail((1,), "bad_request", "boom"),
                 id="terminal single: dead-lettered"),
    pytest.param(err(TERMINAL, "too_large", status=413), [job(1, attempts=1, max_attempts=5)], True,
                 Fail((1,), "too_large", "boom"), id="terminal single: attempts left do not matter"),
    pytest.param(err(TERMINAL, "bad_request", status=400), TWO, True,
                 Split(((job(1),), (job(2),))), id="terminal pair: split"),
    pytest.param(err(TERMINAL, "bad_request", status=400), FIVE, True,
                 Split((tuple(FIVE[:2]), tuple(FIVE[2:]))), id="terminal batch: split in halves"),
    pytest.param(err(TERMINAL, "bad_request", status=400, message="dimensions not supported"), FIVE, False,
                 Stop((1, 2, 3, 4, 5), ProviderError(FATAL, "config_rejected", "dimensions not supported", 400)),
                 id="terminal when the config probe fails: stop"),
    pytest.param(err(TERMINAL, "bad_request", status=400), ONE, False,
                 Stop((1,), ProviderError(FATAL, "config_rejected", "boom", 400)),
                 id="terminal single when the config probe fails: stop"),
    # FATAL: auth and configuration: hand back untouched and stop.
    pytest.param(err(FATAL, "auth", status=401), FIVE, None,
                 Stop((1, 2, 3, 4, 5), ProviderError(FATAL, "auth", "boom", 401)), id="fatal: 401"),
    pytest.param(err(FATAL, "model_not_found", status=404), [job(1, attempts=5, max_attempts=5)], True,
                 Stop((1,), ProviderError(FATAL, "model_not_found", "boom", 404)),
                 id="fatal: exhausted attempts are not touched"),
]


def same_error(a: ProviderError, b: ProviderError) -> bool:
    return (a.kind, a.error_class, a.message, a.status, a.retry_after) == \
           (b.kind, b.error_class, b.message, b.status, b.retry_after)


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
    error = err(RETRYABLE, "timeout")
    jobs = [job(i, attempts=a) for i, a in enumerate([1, 2, 3, 4, 8], start=1)]
    first, again = run(error, jobs, seed=7), run(error, jobs, seed=7)
    assert first.delays == again.delays
    assert run(error, jobs, seed=8).delays != first.delays


@pytest.mark.parametrize("attempts", [1, 2, 3, 6, 10])
def test_retry_delays_are_full_jitter_bounded_by_the_attempt(attempts):
    jobs = [job(i, attempts=attempts, max_attempts=20) for i in range(200)]
    delays = retry_delays(jobs, base=BASE, cap=CAP, rng=random.Random(SEED))
    bound = min(CAP, BASE * 2 ** attempts)
    assert all(0.0 <= d <= bound for d in delays)
    assert max(delays) > 0.8 * bound


def test_retry_after_above_the_cap_still_wins():
    out = run(err(RETRYABLE, "server_error", retry_after=600.0), [job(1, attempts=10)])
    assert out.delays == (600.0,)


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
        elif isinstance(outcome, Fail):
            failed.extend(outcome.job_ids)
    assert probes == 1 and failed == [bad]


# -- worker errors and the answer's dimension ------------------------------------------------------

def test_worker_error_counts_the_attempt_without_blaming_the_provider():
    jobs = [job(1), job(2, attempts=5, max_attempts=5)]
    out = worker_error(RuntimeError("connection reset sk-abcdefghijklmnop"), jobs, base=BASE, cap=CAP,
                       rng=random.Random(SEED))
    assert out.job_ids == (1, 2)
    assert out.delays == expected_delays(jobs)
    assert out.error_class == "worker_error"
    assert out.message.startswith("RuntimeError: connection reset") and "sk-abcdefghijklmnop" not in out.message
    assert out.breaker is None
    assert out.exhausted == (2,)


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
