"""After a successful call: the answer judged before anything is stored. ``check_vectors``
stops the worker on vectors of the wrong dimension (a misconfigured endpoint); ``bad_vectors``
retries the inputs whose vectors are not finite (the provider's fault) and ``without`` keeps
the others to complete. Pure: no database, no provider, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pipeline_assets.jobqueue.changes import ClaimedJob, Retry
from pipeline_assets.jobqueue.decisions import retry_delays
from pipeline_assets.jobqueue.outcomes import Apply, BreakerFailure, Stop
from pipeline_assets.providers import FATAL, ProviderError

# The error class of an answer carrying a NaN or infinite vector.
BAD_VECTOR = "bad_vector"


def bad_vectors(
    finite: Sequence[bool], jobs: Sequence[ClaimedJob], *, base: float, cap: float, rng: random.Random | None = None
) -> Apply | None:
    """After a successful call: a NaN or infinite vector is the provider's
    fault, and the answer names the input it was returned for: those jobs are
    retried (the attempt counts, the breaker counts a failure); the others
    complete. ``finite`` holds, per vector, whether all its components are
    finite."""
    bad = [j for j, ok in zip(jobs, finite) if not ok]
    if not bad:
        return None
    return Apply(
        (
            Retry(
                tuple(j.job_id for j in bad),
                retry_delays(bad, base=base, cap=cap, rng=rng),
                BAD_VECTOR,
                f"provider returned a vector with NaN or infinite components for {len(bad)} of {len(jobs)} inputs",
            ),
        ),
        BreakerFailure(trip=False, floor=0.0),
    )


def without(job_ids: Sequence[int], jobs: Sequence[ClaimedJob], vectors: Sequence) -> tuple[list, list]:
    """The jobs of an answer (and their vectors) other than ``job_ids``."""
    drop = set(job_ids)
    kept = [(j, v) for j, v in zip(jobs, vectors) if j.job_id not in drop]
    return [j for j, _ in kept], [v for _, v in kept]


def check_vectors(
    dimensions: Sequence[int], jobs: Sequence[ClaimedJob], *, expected: int | None, model_id: str
) -> Stop | None:
    """After a successful call: vectors of the wrong dimension mean a
    misconfigured endpoint, not bad items, so stop and touch nothing (every
    answer would be as wrong: no point in a few more). ``dimensions`` holds the
    length of each returned vector; ``expected`` None: the model's dimension is
    not known yet (the first answer records it)."""
    got = set(dimensions)
    if expected is None or got == {expected}:
        return None
    return Stop(
        tuple(j.job_id for j in jobs),
        ProviderError(
            FATAL,
            "dimension_mismatch",
            f"provider returned {sorted(got)}-dimensional vectors for {model_id}, which has {expected} dimensions",
        ),
    )
