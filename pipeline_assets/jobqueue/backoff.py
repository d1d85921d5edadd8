"""Retry delays: full-jitter exponential backoff with the provider's Retry-After as a floor.

Full jitter draws uniformly from [0, min(cap, base * 2**attempt)] so that many
workers that failed together do not retry together.
"""

from __future__ import annotations

import random


def full_jitter(attempt: int, *, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Delay before retry number ``attempt`` (1-based attempts already made)."""
    # 2**62 already exceeds any sane cap; clamping keeps the float math finite.
    bound = min(cap, base * (2 ** min(max(attempt, 0), 62)))
    return (rng or random).uniform(0.0, bound)


def retry_delay(
    attempt: int, *, base: float, cap: float, retry_after: float | None = None, rng: random.Random | None = None
) -> float:
    delay = full_jitter(attempt, base=base, cap=cap, rng=rng)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay
