"""The job state machine: guarded transitions over app.embedding_jobs.

Knows nothing of providers, workers or Dagster. Each function is one short
statement (or one short transaction) and returns which jobs it moved.

    pending ──claim──► processing ──complete──► ready
       ▲                 │  │  │                  │
       │ requeue/revive  │  │  └─lost content──► superseded ◄── (content gone)
       │                 │  └─retryable/expired─► retry ──claim──► processing
     failed ◄─terminal / attempts exhausted─┘
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import psycopg

from pipeline_assets.jobs import queries


@dataclass(frozen=True)
class ClaimedJob:
    job_id: int
    chunk_checksum: bytes
    attempts: int
    max_attempts: int
    text: str | None  # None: no current chunk carries the checksum any more
    token_count: int | None = None
    probe: bool = False  # this claim is the half-open breaker's probe


def claim(conn: psycopg.Connection, *, model_id: str, owner: str, limit: int,
          lease_seconds: float) -> list[ClaimedJob]:
    rows = conn.execute(queries.CLAIM, {"model": model_id, "owner": owner, "limit": limit,
                                        "lease": lease_seconds}).fetchall()
    return [ClaimedJob(*row) for row in rows]


def complete(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int],
             vectors: Sequence[np.ndarray]) -> tuple[list[int], list[int]]:
    """Store vectors for jobs still held and wanted; supersede held-but-unwanted ones.

    Returns (ready_ids, superseded_ids); any other id was refused (lease lost).
    """
    ids = list(job_ids)
    with _atomic(conn):
        ready = [r[0] for r in conn.execute(
            queries.COMPLETE, {"ids": ids, "vecs": [np.asarray(v, dtype=np.float32) for v in vectors],
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
    return [r[0] for r in conn.execute(queries.SUPERSEDE_HELD, {"ids": list(job_ids), "owner": owner})]


def fail_retryable(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int],
                   delays: Sequence[float], error_class: str, message: str) -> dict[int, str]:
    rows = conn.execute(queries.FAIL_RETRYABLE, {"ids": list(job_ids), "delays": list(delays),
                                                  "owner": owner, "cls": error_class, "msg": message})
    return {r[0]: r[1] for r in rows}


def give_back(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], delay: float = 0.0,
              error_class: str | None = None, message: str | None = None) -> list[int]:
    """Return held jobs without consuming their attempt (throttle, shutdown, fatal config)."""
    if not job_ids:
        return []
    return [r[0] for r in conn.execute(queries.GIVE_BACK, {
        "ids": list(job_ids), "owner": owner, "delay": delay, "cls": error_class, "msg": message})]


def fail_terminal(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], error_class: str,
                  message: str) -> list[int]:
    return [r[0] for r in conn.execute(queries.FAIL_TERMINAL, {
        "ids": list(job_ids), "owner": owner, "cls": error_class, "msg": message})]


def extend_lease(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], lease_seconds: float) -> int:
    cur = conn.execute(queries.EXTEND_LEASE, {"ids": list(job_ids), "owner": owner, "lease": lease_seconds})
    return cur.rowcount


def rescue_expired(conn: psycopg.Connection) -> dict[str, int]:
    """Expired leases (dead or stalled workers) go back to retry, or to failed when exhausted."""
    counts = {"retry": 0, "failed": 0, "superseded": 0}
    for _, status in conn.execute(queries.RESCUE_EXPIRED):
        counts[status] += 1
    return counts


def requeue_failed(conn: psycopg.Connection, job_ids: Sequence[int] = (), *, all_failed: bool = False
                   ) -> dict[str, int]:
    counts = {"pending": 0, "superseded": 0}
    for _, status in conn.execute(queries.REQUEUE_FAILED, {"ids": list(job_ids), "all": all_failed}):
        counts[status] += 1
    return counts


def supersede_unwanted(conn: psycopg.Connection, checksums: Sequence[bytes] | None = None) -> int:
    """Supersede jobs whose content nobody wants, and delete their vectors."""
    if checksums is None:
        gone = conn.execute(queries.SUPERSEDE_UNWANTED).fetchall()
    else:
        gone = conn.execute(queries.SUPERSEDE_UNWANTED_AMONG, {"checksums": list(checksums)}).fetchall()
    if gone:
        conn.execute(queries.DELETE_VECTORS, {"checksums": [g[0] for g in gone], "models": [g[1] for g in gone]})
    return len(gone)


def revive_wanted(conn: psycopg.Connection, checksums: Sequence[bytes] | None = None) -> int:
    if checksums is None:
        return conn.execute(queries.REVIVE_WANTED).rowcount
    return conn.execute(queries.REVIVE_WANTED_AMONG, {"checksums": list(checksums)}).rowcount


def enqueue_for_docs(conn: psycopg.Connection, doc_pks: Sequence[int], max_attempts: int) -> int:
    if not doc_pks:
        return 0
    return conn.execute(queries.ENQUEUE_FOR_DOCS, {"docs": list(doc_pks), "max_attempts": max_attempts}).rowcount


def enqueue_missing(conn: psycopg.Connection, max_attempts: int) -> int:
    return conn.execute(queries.ENQUEUE_MISSING, {"max_attempts": max_attempts}).rowcount


def drop_orphan_keys(conn: psycopg.Connection) -> int:
    return conn.execute(queries.DROP_ORPHAN_KEYS).rowcount


def repair_missing_vectors(conn: psycopg.Connection) -> int:
    return conn.execute(queries.REPAIR_MISSING_VECTORS).rowcount


def outstanding(conn: psycopg.Connection, model_id: str) -> tuple[bool, bool]:
    """Whether a model has jobs waiting (claimable or on retry) and jobs under a
    lease. Two EXISTS probes, each answered by a partial index: cheap to poll."""
    row = conn.execute(queries.OUTSTANDING, {"model": model_id}).fetchone()
    return bool(row[0]), bool(row[1])


def provider_failure(conn: psycopg.Connection, model_id: str, *, trip: bool, floor: float, base: float,
                     cap: float, threshold: int) -> tuple[bool, bool]:
    """Count a provider failure for every worker; returns (paused now, tripped)."""
    row = conn.execute(queries.PROVIDER_FAILURE, {"model": model_id, "trip": trip, "floor": floor,
                                                  "base": base, "cap": cap, "threshold": threshold}).fetchone()
    return row[0], row[1]


def pause_provider(conn: psycopg.Connection, model_id: str, seconds: float) -> int:
    """Trip the breaker for exactly ``seconds`` (never shortening a longer pause);
    returns the consecutive failure count."""
    row = conn.execute(queries.PROVIDER_FAILURE, {"model": model_id, "trip": True, "floor": seconds,
                                                  "base": 0.0, "cap": 0.0, "threshold": 1}).fetchone()
    return row[2]


def provider_healthy(conn: psycopg.Connection, model_id: str) -> None:
    conn.execute(queries.PROVIDER_HEALTHY, {"model": model_id})
