"""Which claimed jobs go together in a provider request, and how a job's faults and throttles shrink
its requests. Pure: no database, no provider, no clock.

``plan_requests`` groups a claim's jobs into requests bounded by inputs and tokens; a job whose
faults or throttles are evidence against its inputs (``jobqueue.evidence``) travels in smaller requests,
until it is alone (docs/state-machine.md, Failures).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline_assets.jobqueue.changes import ClaimedJob

# A job's request is halved once for every throttle from this one on: one 429
# is the provider's weather; repeated ones on the same inputs suggest a request
# too large for the account's limits (tokens per minute, a gateway's budget).
THROTTLE_SHRINK_AFTER = 3
# Bounds the halvings (2**62 inputs is beyond any request).
MAX_HALVINGS = 62

# Transient faults (5xx, timeout, dropped connection, unusable answer) a job
# may meet, counted from the evidence threshold ``k`` (``jobqueue.evidence``: 2 for a
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


def halvings(throttles: int, threshold: int = THROTTLE_SHRINK_AFTER) -> int:
    """How many times a job's requests are halved after ``throttles`` throttles
    (``threshold``: the throttles that are evidence, ``jobqueue.evidence``)."""
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


def plan_requests(
    jobs: Sequence[ClaimedJob],
    *,
    max_inputs: int,
    max_tokens: int,
    fault_threshold: int = 1,
    throttle_threshold: int = THROTTLE_SHRINK_AFTER,
) -> list[list[ClaimedJob]]:
    """Group jobs into requests bounded by inputs and tokens; jobs without text are left out.

    A job marked ``isolate`` (in a batch refused for a bad input whose split was cut short) goes alone,
    so a poison input no longer drags neighbours through its retries. A job with faults goes in a request
    of at most ``fault_cap`` inputs (most faults first: a request's cap is its first job's). Jobs
    throttled ``throttle_threshold`` times or more travel only with jobs throttled as often, in requests
    of at most half their group and of the batch (inputs and tokens) halved once per further throttle: a
    request the provider never accepts is whittled down to the one input it refuses. Below
    ``fault_threshold`` and ``throttle_threshold`` (``jobqueue.evidence``) a job keeps the batch size.
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


def _fill(
    jobs: Sequence[ClaimedJob], max_inputs: int, max_tokens: int, fault_threshold: int = 1
) -> list[list[ClaimedJob]]:
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


def unwanted(jobs: Sequence[ClaimedJob]) -> list[int]:
    """Ids of claimed jobs whose content no current chunk carries any more."""
    return [j.job_id for j in jobs if j.text is None]
