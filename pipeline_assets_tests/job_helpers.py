"""One transition at a time, for tests and benchmarks: each is one
``transitions.apply`` of a single change on a connection, returning what moved
(the worker applies batches through ``JobStore.apply``); and a breaker tripped for a while."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import psycopg
from psycopg.rows import dict_row

from pipeline_assets.jobqueue.changes import Complete, Fail, GiveBack, Retry
from pipeline_assets.jobqueue.provider_state import JOBS
from pipeline_assets.jobqueue.status import JobStatus
from pipeline_assets.jobqueue.transitions import apply, became


def complete(
    conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], vectors: Sequence[np.ndarray]
) -> tuple[list[int], list[int]]:
    """Returns (ready_ids, superseded_ids); any other id was refused (lease lost)."""
    now = became(
        apply(conn, owner, [Complete(tuple(job_ids), tuple(np.asarray(v, dtype=np.float32) for v in vectors))])
    )
    return (
        [i for i in job_ids if now.get(i) == JobStatus.READY],
        [i for i in job_ids if now.get(i) == JobStatus.SUPERSEDED],
    )


def fail_retryable(
    conn: psycopg.Connection,
    *,
    owner: str,
    job_ids: Sequence[int],
    delays: Sequence[float],
    error_class: str,
    message: str,
) -> dict[int, str]:
    return became(apply(conn, owner, [Retry(tuple(job_ids), tuple(delays), error_class, message)]))


def give_back(
    conn: psycopg.Connection,
    *,
    owner: str,
    job_ids: Sequence[int],
    delay: float = 0.0,
    error_class: str | None = None,
    message: str | None = None,
    throttled: bool = False,
    faulted: bool = False,
) -> list[int]:
    """Return held jobs without consuming their attempt; ``throttled``/``faulted``
    count a throttle / a transient fault charged to the request on each."""
    return list(became(apply(conn, owner, [GiveBack(tuple(job_ids), delay, error_class, message, throttled, faulted)])))


def fail_terminal(
    conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], error_class: str, message: str
) -> list[int]:
    return list(became(apply(conn, owner, [Fail(tuple(job_ids), error_class, message)])))


def pause_provider(conn: psycopg.Connection, model_id: str, seconds: float) -> int:
    """Trip the breaker for exactly ``seconds`` (never shortening a longer pause);
    returns the consecutive failure count."""
    params = {
        "model": model_id,
        "trip": True,
        "floor": seconds,
        "base": 0.0,
        "cap": 0.0,
        "threshold": 1,
        "probe_cap": 0.0,
    }
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(JOBS.provider_failure, params).fetchall()[0]["consecutive_failures"]
