"""The job state machine: guarded transitions over app.embedding_jobs (diagram:
docs/state-machine.md).

Knows nothing of providers, workers or Dagster. Each function is one short statement (or one
short transaction) and returns which jobs it moved. The SQL is sql/queries/jobs.sql
(``JOBS.<name>``); the states are ``JobStatus``; the transitions of held jobs are the values of
``jobqueue.changes``, applied by ``apply`` (one statement per kind). The provider's state that
every worker shares (breaker, pause, unusable answers) is ``jobqueue.provider_state``'s.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import psycopg
from psycopg import sql
from psycopg.rows import RowMaker, dict_row

from pipeline_assets.jobqueue import ledger
from pipeline_assets.jobqueue.changes import (
    Change,
    ClaimedJob,
    Complete,
    Fail,
    GiveBack,
    Isolate,
    Retry,
    Supersede,
    merged,
    params,
)
from pipeline_assets.jobqueue.request_plan import FREE_FAULTS
from pipeline_assets.jobqueue.status import JobStatus
from pipeline_assets.store import arrays, queries
from pipeline_assets.store.vectors import param as vectors_param

__all__ = ["ClaimedJob", "apply", "claim"]

JOBS = queries.load("jobs")

# The guarded statement of each kind of transition of a held job.
_QUERY = {
    Complete: JOBS.complete,
    Retry: JOBS.fail_retryable,
    GiveBack: JOBS.give_back,
    Fail: JOBS.fail_terminal,
    Supersede: JOBS.supersede_held,
    Isolate: JOBS.mark_isolated,
}


@functools.cache
def claim_statement(scoped: bool, limit: int) -> bytes:
    """The claim statement for one scope and batch size, composed (and encoded)
    once per process: psycopg would compose a ``sql.Composed`` again at every
    execute. The batch size is a literal so that the plan the server caches for
    the prepared statement is costed for it (see jobs.sql: claim)."""
    scope = JOBS.claim_scope_docs if scoped else JOBS.claim_scope_all
    return sql.SQL(JOBS.claim).format(scope=sql.SQL(scope), limit=sql.Literal(int(limit))).as_bytes(None)


def claim(
    conn: psycopg.Connection,
    *,
    model_id: str,
    owner: str,
    limit: int,
    lease_seconds: float,
    docs: Sequence[int] | None = None,
) -> list[ClaimedJob]:
    """Claim up to ``limit`` claimable jobs of the model; with ``docs`` (doc_pks)
    only the jobs of those documents' chunks."""
    with conn.cursor(row_factory=_claimed_jobs) as cur:
        return cur.execute(
            claim_statement(docs is not None, limit),
            {
                "model": model_id,
                "owner": owner,
                "lease": lease_seconds,
                "docs": list(docs) if docs is not None else None,
            },
        ).fetchall()


def _claimed_jobs(cursor: psycopg.Cursor) -> RowMaker[ClaimedJob]:
    """Rows of the claim as ``ClaimedJob`` values, built positionally (the claim's
    columns are its fields, in order; checked once per statement)."""
    names = tuple(column.name for column in cursor.description or ())
    if names != ClaimedJob._fields:
        raise psycopg.ProgrammingError(f"the claim returns {names}, not the fields of ClaimedJob")
    return ClaimedJob._make


def apply(conn: psycopg.Connection, owner: str, changes: Sequence[Change]) -> list[tuple[Change, dict[int, str]]]:
    """Apply a batch of transitions of jobs held under ``owner``, one statement
    per kind, in one transaction (unless the caller already opened one; a
    single statement on an autocommit connection is its own transaction).

    Returns each applied change with what its jobs became (job id -> status);
    a job missing from it was refused (its lease was lost, or it was not in the
    state the transition leaves). A ``Complete`` supersedes, in its own
    statement, the held jobs whose content is no longer wanted: they are
    returned as a ``Supersede`` of the jobs it did not store.
    """
    out: list[tuple[Change, dict[int, str]]] = []
    batch = merged(changes)
    with _atomic(conn, len(batch)):
        for change in batch:
            moved = _run(conn, change, owner)
            if not isinstance(change, Complete):
                out.append((change, moved))
                continue
            ready = {i: s for i, s in moved.items() if s == JobStatus.READY}
            out.append((change, ready))
            if len(ready) < len(change.job_ids):
                rest = Supersede(tuple(i for i in change.job_ids if i not in ready))
                out.append((rest, {i: s for i, s in moved.items() if s != JobStatus.READY}))
    return out


# The settlement of the call a Complete names: answered and billed (ledger.sql record_outcome).
_ANSWERED = {"outcome": "ok", "http_status": 200, "billed": ledger.BILLED}


def _run(conn: psycopg.Connection, change: Change, owner: str) -> dict[int, str]:
    values = params(change) | {"owner": owner, "job_ids": arrays.int8(conn, change.job_ids)}
    if isinstance(change, Complete):  # one binary vector[] encoded in one numpy pass
        values["vectors"] = vectors_param(conn, change.vectors)
        values.update(_ANSWERED)
    rows = conn.execute(_QUERY[type(change)], values).fetchall()
    return {job_id: status for job_id, status in rows}


def became(applied: Sequence[tuple[Change, dict[int, str]]]) -> dict[int, str]:
    """What each job of an ``apply`` ended as (its last transition wins)."""
    out: dict[int, str] = {}
    for _, moved in applied:
        out.update(moved)
    return out


def _atomic(conn: psycopg.Connection, statements: int) -> contextlib.AbstractContextManager[psycopg.Transaction | None]:
    """A transaction, unless the caller already opened one (no savepoint round
    trips) or it is one statement on an autocommit connection (its own implicit
    transaction: no BEGIN and COMMIT round trips)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE or (statements <= 1 and conn.autocommit):
        return contextlib.nullcontext()
    return conn.transaction()


def extend_lease(conn: psycopg.Connection, *, owner: str, job_ids: Sequence[int], lease_seconds: float) -> int:
    cur = conn.execute(JOBS.extend_lease, {"job_ids": list(job_ids), "owner": owner, "lease": lease_seconds})
    return cur.rowcount


def rescue_expired(
    conn: psycopg.Connection,
    *,
    rescuer: str | None = None,
    base: float = 0.0,
    cap: float = 0.0,
    free_faults: int = FREE_FAULTS,
) -> dict[str, int]:
    """Expired leases (dead or stalled workers) go back to be claimed again, their
    attempt given back and a fault counted; the only job rescued from its worker
    process, after ``free_faults`` faults, keeps its attempt used (retry, or failed
    when exhausted).
    Returns the jobs rescued by the status they got (pending and retry counted as retry).

    ``rescuer``: the owner prefix of a live worker (``app.workers``); with it,
    the claims of workers that stopped beating are rescued too, without waiting
    for their leases. ``base``/``cap``: the full-jitter backoff a rescued job
    waits out (0: available at once).
    """
    counts: dict[str, int] = {JobStatus.RETRY: 0, JobStatus.FAILED: 0, JobStatus.SUPERSEDED: 0}
    for row in _dicts(
        conn, JOBS.rescue_expired, {"rescuer": rescuer, "base": base, "cap": cap, "free_faults": free_faults}
    ):
        status = JobStatus.RETRY if row["status"] == JobStatus.PENDING else row["status"]
        counts[status] += 1
    return counts


def requeue_failed(
    conn: psycopg.Connection, job_ids: Sequence[int] = (), *, all_failed: bool = False
) -> dict[str, int]:
    counts: dict[str, int] = {JobStatus.PENDING: 0, JobStatus.SUPERSEDED: 0}
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
        conn.execute(
            JOBS.delete_vectors,
            {"checksums": [g["chunk_checksum"] for g in gone], "models": [g["model_id"] for g in gone]},
        )
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
    """Jobs for the current chunks of some documents, for every active model without one; returns
    how many. Each key is probed in the index: a cost that follows the documents, not the job table."""
    if not doc_pks:
        return 0
    # One binary bigint[]: psycopg's list dumper costs ~250 bytes and ~20 us per key (a million: 20 s, 250 MB).
    return conn.execute(JOBS.enqueue_docs, {"docs": arrays.int8(conn, doc_pks), "max_attempts": max_attempts}).rowcount


def enqueue_chunks(conn: psycopg.Connection, checksums: Sequence[bytes], max_attempts: int) -> tuple[int, int]:
    """Jobs for chunks this transaction has just written (``checksums`` distinct): enqueued for every
    active model without one, revived where superseded. Returns (enqueued, revived); a cost that
    follows the batch, not the job table."""
    if not checksums:
        return 0, 0
    enqueued, revived = queries.one_row(
        conn, JOBS.enqueue_chunks, {"checksums": arrays.bytea(conn, checksums), "max_attempts": max_attempts}
    )
    return enqueued, revived


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


def _dicts(conn: psycopg.Connection, query: str, params: dict | None = None) -> list[dict]:
    """The rows of one statement, each a dict keyed by column name."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()
