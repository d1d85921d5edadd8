"""The job state machine: guarded transitions over app.embedding_jobs.

Knows nothing of providers, workers or Dagster. Each function is one short
statement (or one short transaction) and returns which jobs it moved. The SQL
is in sql/queries/jobs.sql (``JOBS.<name>``); the states are ``JobStatus``.

    pending ──claim──► processing ──complete──► ready
       ▲                 │  │  │                  │
       │ requeue/revive  │  │  └─lost content──► superseded ◄── (content gone)
       │                 │  └─retryable/expired─► retry ──claim──► processing
     failed ◄─terminal / attempts exhausted─┘
"""

from __future__ import annotations

import functools

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import psycopg
from psycopg import sql
from psycopg.rows import class_row, dict_row

from pipeline_assets.jobs.status import JobStatus
from pipeline_assets.store import queries

JOBS = queries.load("jobs")


@dataclass(frozen=True)
class ClaimedJob:
    job_id: int
    chunk_checksum: bytes
    attempts: int
    max_attempts: int
    text: str | None  # None: no current chunk carries the checksum any more
    token_count: int | None = None
    probe: bool = False  # this claim is the half-open breaker's probe
    throttles: int = 0  # 429s this job met (they use no attempt; past a cap a lone input fails)
    isolate: bool = False  # it was in a batch refused for a bad input: send it alone


def claim(conn: psycopg.Connection, *, model_id: str, owner: str, limit: int,
          lease_seconds: float) -> list[ClaimedJob]:
    with conn.cursor(row_factory=class_row(ClaimedJob)) as cur:
        return cur.execute(JOBS.claim, {"model": model_id, "owner": owner, "limit": limit,
                                        "lease": lease_seconds}).fetchall()


def complete(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int],
             vectors: Sequence[np.ndarray]) -> tuple[list[int], list[int]]:
    """Store vectors for jobs still held and wanted; supersede held-but-unwanted ones.

    Returns (ready_ids, superseded_ids); any other id was refused (lease lost).
    """
    ids = list(job_ids)
    with _atomic(conn):
        ready = [r[0] for r in conn.execute(
            JOBS.complete, {"ids": ids, "vecs": [np.asarray(v, dtype=np.float32) for v in vectors],
                            "owner": owner})]
        if len(ready) == len(ids):
            return ready, []
        won = set(ready)
        superseded = supersede_held(conn, owner=owner, job_ids=[i for i in ids if i not in won])
    return ready, superseded


def _atomic(conn: psycopg.Connection):
    """A transaction, unless the caller already opened one (no savepoint round trips)."""
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return conn.transaction()
    return contextlib.nullcontext()


def supersede_held(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int]) -> list[int]:
    if not job_ids:
        return []
    return [r[0] for r in conn.execute(JOBS.supersede_held, {"ids": list(job_ids), "owner": owner})]


def fail_retryable(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int],
                   delays: Sequence[float], error_class: str, message: str) -> dict[int, str]:
    rows = _dicts(conn, JOBS.fail_retryable, {"ids": list(job_ids), "delays": list(delays),
                                              "owner": owner, "cls": error_class, "msg": message})
    return {r["job_id"]: r["status"] for r in rows}


def give_back(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], delay: float = 0.0,
              error_class: str | None = None, message: str | None = None, throttled: bool = False) -> list[int]:
    """Return held jobs without consuming their attempt (throttle, a fault of our
    own, shutdown, fatal config); ``throttled`` counts a throttle on each."""
    if not job_ids:
        return []
    return [r[0] for r in conn.execute(JOBS.give_back, {
        "ids": list(job_ids), "owner": owner, "delay": delay, "cls": error_class, "msg": message,
        "throttled": throttled})]


def mark_isolated(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int]) -> int:
    """Held jobs of a batch refused for a bad input: each goes alone next time."""
    return conn.execute(JOBS.mark_isolated, {"ids": list(job_ids), "owner": owner}).rowcount


def release_probe(conn: psycopg.Connection, model_id: str, owner: str) -> int:
    """Free the half-open probe slot if the claim ``owner`` holds it."""
    return conn.execute(JOBS.release_probe, {"model": model_id, "owner": owner}).rowcount


def fail_terminal(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], error_class: str,
                  message: str) -> list[int]:
    return [r[0] for r in conn.execute(JOBS.fail_terminal, {
        "ids": list(job_ids), "owner": owner, "cls": error_class, "msg": message})]


def extend_lease(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], lease_seconds: float) -> int:
    cur = conn.execute(JOBS.extend_lease, {"ids": list(job_ids), "owner": owner, "lease": lease_seconds})
    return cur.rowcount


def rescue_expired(conn: psycopg.Connection, *, rescuer: str | None = None, base: float = 0.0,
                   cap: float = 0.0) -> dict[str, int]:
    """Expired leases (dead or stalled workers) go back to retry, or to failed when exhausted.

    ``rescuer``: the owner prefix of a live worker (``app.workers``); with it,
    the claims of workers that stopped beating are rescued too, without waiting
    for their leases. ``base``/``cap``: the full-jitter backoff a rescued job
    waits out (0: available at once).
    """
    counts = {JobStatus.RETRY: 0, JobStatus.FAILED: 0, JobStatus.SUPERSEDED: 0}
    for row in _dicts(conn, JOBS.rescue_expired, {"rescuer": rescuer, "base": base, "cap": cap}):
        counts[row["status"]] += 1
    return counts


def requeue_failed(conn: psycopg.Connection, job_ids: Sequence[int] = (), *, all_failed: bool = False
                   ) -> dict[str, int]:
    counts = {JobStatus.PENDING: 0, JobStatus.SUPERSEDED: 0}
    for row in _dicts(conn, JOBS.requeue_failed, {"ids": list(job_ids), "all": all_failed}):
        counts[row["status"]] += 1
    return counts


def supersede_unwanted(conn: psycopg.Connection, checksums: Sequence[bytes] | None = None) -> int:
    """Supersede jobs whose content nobody wants, and delete their vectors."""
    if checksums is None:
        gone = _dicts(conn, JOBS.supersede_unwanted)
    else:
        gone = _dicts(conn, JOBS.supersede_unwanted_among, {"checksums": list(checksums)})
    if gone:
        conn.execute(JOBS.delete_vectors, {"checksums": [g["chunk_checksum"] for g in gone],
                                           "models": [g["model_id"] for g in gone]})
    return len(gone)


def revive_wanted(conn: psycopg.Connection, checksums: Sequence[bytes] | None = None) -> int:
    if checksums is None:
        return conn.execute(JOBS.revive_wanted).rowcount
    return conn.execute(JOBS.revive_wanted_among, {"checksums": list(checksums)}).rowcount


@functools.cache
def _enqueue(scope: str) -> sql.Composed:
    """The enqueue statement for one scope, composed once per process."""
    return sql.SQL(JOBS.enqueue).format(scope=sql.SQL(scope))


def enqueue_for_docs(conn: psycopg.Connection, doc_pks: Sequence[int], max_attempts: int) -> int:
    if not doc_pks:
        return 0
    return conn.execute(_enqueue(JOBS.enqueue_scope_docs),
                        {"docs": list(doc_pks), "max_attempts": max_attempts}).rowcount


def enqueue_missing(conn: psycopg.Connection, max_attempts: int) -> int:
    return conn.execute(_enqueue(JOBS.enqueue_scope_missing), {"max_attempts": max_attempts}).rowcount


def drop_orphan_keys(conn: psycopg.Connection) -> int:
    return conn.execute(JOBS.drop_orphan_keys).rowcount


def repair_missing_vectors(conn: psycopg.Connection) -> int:
    return conn.execute(JOBS.repair_missing_vectors).rowcount


def outstanding(conn: psycopg.Connection, model_id: str) -> tuple[bool, bool]:
    """Whether a model has jobs waiting (claimable or on retry) and jobs under a
    lease. Two EXISTS probes, each answered by a partial index: cheap to poll."""
    row = _dicts(conn, JOBS.outstanding, {"model": model_id})[0]
    return bool(row["waiting"]), bool(row["held"])


def provider_failure(conn: psycopg.Connection, model_id: str, *, trip: bool, floor: float, base: float,
                     cap: float, threshold: int) -> tuple[bool, bool]:
    """Count a provider failure for every worker; returns (paused now, tripped)."""
    row = _dicts(conn, JOBS.provider_failure, {"model": model_id, "trip": trip, "floor": floor,
                                               "base": base, "cap": cap, "threshold": threshold})[0]
    return row["paused"], row["tripped"]


def pause_provider(conn: psycopg.Connection, model_id: str, seconds: float) -> int:
    """Trip the breaker for exactly ``seconds`` (never shortening a longer pause);
    returns the consecutive failure count."""
    row = _dicts(conn, JOBS.provider_failure, {"model": model_id, "trip": True, "floor": seconds,
                                               "base": 0.0, "cap": 0.0, "threshold": 1})[0]
    return row["consecutive_failures"]


def provider_healthy(conn: psycopg.Connection, model_id: str) -> None:
    conn.execute(JOBS.provider_healthy, {"model": model_id})


def _dicts(conn: psycopg.Connection, query: str, params: dict | None = None) -> list[dict]:
    """The rows of one statement, each a dict keyed by column name."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()
