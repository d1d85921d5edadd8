"""The rows of the dead-letter queue (SQL: ``sql/queries/dlq.sql``): failed jobs and quarantined
documents, open or discarded, a job's recorded attempts and a document's stage rows; requeue's
selection and discards. Each row is a dict keyed by column name."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
from psycopg.rows import dict_row

from pipeline_assets.store import queries

DLQ = queries.load("dlq")


def groups(conn: psycopg.Connection) -> list[dict]:
    """Open and discarded items by kind and error class, with their first and last failure."""
    return _dicts(conn, DLQ.groups)


def job_items(conn: psycopg.Connection, error_class: str | None, discarded: bool) -> list[dict]:
    """Failed jobs (of one error class, or every one): the open ones, or the discarded ones."""
    return _dicts(conn, DLQ.job_items, {"cls": error_class, "discarded": discarded})


def document_items(conn: psycopg.Connection, error_class: str | None, discarded: bool) -> list[dict]:
    """Quarantined documents (of one error class, or every one): the open ones, or the discarded ones."""
    return _dicts(conn, DLQ.document_items, {"cls": error_class, "discarded": discarded})


def job(conn: psycopg.Connection, job_id: int) -> dict | None:
    rows = _dicts(conn, DLQ.job, {"id": job_id})
    return rows[0] if rows else None


def attempts(conn: psycopg.Connection, job_id: int) -> list[dict]:
    """The recorded failure transitions of a job (app.job_attempts)."""
    return _dicts(conn, DLQ.attempts, {"id": job_id})


def documents_named(conn: psycopg.Connection, document_id: str) -> list[dict]:
    """The documents of that id, one per source."""
    return _dicts(conn, DLQ.documents_named, {"id": document_id})


def document_stages(conn: psycopg.Connection, doc_pk: int) -> list[dict]:
    return _dicts(conn, DLQ.document_stages, {"doc": doc_pk})


def set_actor(conn: psycopg.Connection, actor: str) -> None:
    """Name who makes this transaction's transitions (the attempts history records it)."""
    conn.execute(DLQ.set_actor, {"actor": actor})


def requeue_job_ids(conn: psycopg.Connection, error_class: str | None) -> list[int]:
    """The open failed jobs (of one error class, or every one) requeue sends back."""
    return [r["job_id"] for r in _dicts(conn, DLQ.requeue_job_ids, {"cls": error_class})]


def lift_document_discards(conn: psycopg.Connection, doc_pks: Sequence[int]) -> None:
    conn.execute(DLQ.lift_document_discards, {"docs": list(doc_pks)})


def discard_jobs(conn: psycopg.Connection, job_ids: Sequence[int], *, by: str, reason: str) -> list[int]:
    """Discard the failed jobs among ``job_ids``; the ids discarded."""
    return [r["job_id"] for r in _dicts(conn, DLQ.discard_jobs, {"by": by, "reason": reason, "ids": list(job_ids)})]


def trim_attempts(conn: psycopg.Connection, job_ids: Sequence[int]) -> None:
    conn.execute(DLQ.trim_attempts, {"ids": list(job_ids)})


def discard_documents(conn: psycopg.Connection, document_ids: Sequence[str], *, by: str, reason: str) -> list[dict]:
    """Discard the quarantined documents among ``document_ids``; the rows discarded."""
    return _dicts(conn, DLQ.discard_documents, {"by": by, "reason": reason, "ids": list(document_ids)})


def _dicts(conn: psycopg.Connection, query: str, params: dict | None = None) -> list[dict]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()
