"""Full-jitter exponential backoff: the bounds, the distribution, the cap, and Retry-After as a floor."""

from __future__ import annotations

import random
import statistics

import pytest

from pipeline_assets.jobqueue import backoff

DRAWS = 2000


@pytest.mark.parametrize("attempt", range(11))
def test_full_jitter_is_uniform_over_zero_to_bound(attempt):
    base, cap = 1, 60
    bound = min(cap, base * 2**attempt)
    rng = random.Random(1000 + attempt)
    draws = [backoff.full_jitter(attempt, base=base, cap=cap, rng=rng) for _ in range(DRAWS)]

    assert all(0.0 <= d <= bound for d in draws), (min(draws), max(draws), bound)
    # Full jitter: mean about half the bound (equal jitter would be 3/4, no jitter the bound itself) ...
    assert abs(statistics.fmean(draws) - bound / 2) <= 0.15 * bound / 2
    # ... spread over the whole range: draws near the bound and near zero.
    assert max(draws) > 0.9 * bound
    assert min(draws) < 0.1 * bound


def test_full_jitter_bounds_double_until_the_cap():
    bounds = []
    for attempt in range(11):
        rng = random.Random(attempt)
        bounds.append(max(backoff.full_jitter(attempt, base=1, cap=60, rng=rng) for _ in range(500)))
    # The observed maximum tracks 1, 2, 4, ... 32, then 60 (capped).
    for attempt, observed in enumerate(bounds):
        expected = min(60, 2**attempt)
        assert 0.9 * expected < observed <= expected, (attempt, observed, expected)


def test_full_jitter_same_seed_same_delays():
    a = [backoff.full_jitter(3, base=0.5, cap=10, rng=random.Random(7)) for _ in range(5)]
    b = [backoff.full_jitter(3, base=0.5, cap=10, rng=random.Random(7)) for _ in range(5)]
    assert a == b


def test_full_jitter_negative_attempt_treated_as_zero():
    rng = random.Random(3)
    assert all(0.0 <= backoff.full_jitter(-5, base=2.0, cap=60.0, rng=rng) <= 2.0 for _ in range(200))


@pytest.mark.parametrize("base", [1, 1.0, 0.05])
def test_cap_respected_for_huge_attempts(base):
    rng = random.Random(42)
    for attempt in (60, 100):
        draws = [backoff.full_jitter(attempt, base=base, cap=60.0, rng=rng) for _ in range(500)]
        assert all(0.0 <= d <= 60.0 for d in draws)
        assert max(draws) > 54.0


def test_cap_respected_beyond_float_range_of_two_to_the_attempt():
    """2**attempt exceeds the float range at attempt 1024; with a float base (the settings' type,
    PIPELINE_BACKOFF_BASE) the product must still be capped, not raise OverflowError."""
    rng = random.Random(5)
    for attempt in (1023, 1024, 10_000):
        delay = backoff.full_jitter(attempt, base=1.0, cap=60.0, rng=rng)
        assert 0.0 <= delay <= 60.0


def test_retry_delay_never_below_retry_after():
    rng = random.Random(11)
    for attempt in range(8):
        for _ in range(200):
            assert backoff.retry_delay(attempt, base=1.0, cap=60.0, retry_after=5.0, rng=rng) >= 5.0


def test_retry_delay_is_retry_after_when_the_jitter_draw_is_smaller():
    # Attempt 0: the draw is at most 1 s, so a Retry-After of 30 s always wins.
    seed = 123
    draw = backoff.full_jitter(0, base=1.0, cap=60.0, rng=random.Random(seed))
    assert draw < 30.0
    assert backoff.retry_delay(0, base=1.0, cap=60.0, retry_after=30.0, rng=random.Random(seed)) == 30.0


def test_retry_delay_is_the_jitter_draw_when_it_is_larger():
    # Find a seed whose draw at attempt 6 (bound 60) exceeds Retry-After = 2 s: the delay is exactly that draw.
    seed = next(s for s in range(100) if backoff.full_jitter(6, base=1.0, cap=60.0, rng=random.Random(s)) > 2.0)
    draw = backoff.full_jitter(6, base=1.0, cap=60.0, rng=random.Random(seed))
    assert draw > 2.0
    assert backoff.retry_delay(6, base=1.0, cap=60.0, retry_after=2.0, rng=random.Random(seed)) == draw


def test_retry_delay_without_retry_after_is_the_jitter_draw():
    draw = backoff.full_jitter(4, base=1.0, cap=60.0, rng=random.Random(9))
    assert backoff.retry_delay(4, base=1.0, cap=60.0, rng=random.Random(9)) == draw
    assert backoff.retry_delay(4, base=1.0, cap=60.0, retry_after=None, rng=random.Random(9)) == draw
