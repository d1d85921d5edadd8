"""Read-only views for people and the Dagster layer (SQL: ``sql/queries/reports.sql``): what
``status`` shows, spend, dead-letter growth, and the per-document and health read models the
Dagster assets, sensors and checks report from. Every function reads; none writes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row

from pipeline_assets.store import queries

REPORTS = queries.load("reports")


def jobs_by_model(conn: psycopg.Connection) -> dict[str, dict[str, int]]:
    """{model: {job status: jobs}}."""
    out: dict[str, dict[str, int]] = {}
    for model_id, status, n in job_rows(conn):
        out.setdefault(model_id, {})[status] = n
    return out


def job_rows(conn: psycopg.Connection) -> list[tuple[str, str, int]]:
    """(model, job status, jobs) rows, ordered."""
    return conn.execute(REPORTS.status_by_model).fetchall()


def stage_counts(conn: psycopg.Connection) -> dict[str, dict[str, int]]:
    """{stage: {status: documents}} of the stored stage rows (extract, chunk)."""
    out: dict[str, dict[str, int]] = {}
    for r in _dicts(conn, REPORTS.stages):
        out.setdefault(r["stage"], {})[r["status"]] = r["n"]
    return out


def coverage_by_model(conn: psycopg.Connection) -> dict[str, dict[str, float]]:
    """{model: ready, wanted, ratio} over the current chunks."""
    return {
        r["model_id"]: {
            "ready": r["ready"],
            "wanted": r["wanted"],
            "ratio": (r["ready"] / r["wanted"] if r["wanted"] else 1.0),
        }
        for r in _dicts(conn, REPORTS.coverage)
    }


def spend(conn: psycopg.Connection) -> dict[str, dict[str, int]]:
    """{model: calls, tokens, inputs_ok, failed_calls, duplicate_inputs, extra_sends}."""
    out = {r.pop("model_id"): r | {"duplicate_inputs": 0, "extra_sends": 0} for r in _dicts(conn, REPORTS.spend)}
    for r in _dicts(conn, REPORTS.duplicate_sends):  # only the models with duplicate sends
        per_model = out.setdefault(r["model_id"], {"calls": 0, "tokens": 0, "inputs_ok": 0, "failed_calls": 0})
        per_model["duplicate_inputs"] = r["inputs_sent_more_than_once"]
        per_model["extra_sends"] = r["extra_sends"]
    return out


def documents_by_status(conn: psycopg.Connection) -> dict[str, int]:
    return {r["status"]: r["n"] for r in _dicts(conn, REPORTS.documents)}


def quarantined_count(conn: psycopg.Connection) -> int:
    return int(queries.scalar(conn, REPORTS.quarantined_count))


def breaker(conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
    """{model: the provider breaker's state}."""
    return {r.pop("model_id"): r for r in _dicts(conn, REPORTS.breaker)}


def breaker_rows(conn: psycopg.Connection) -> list[tuple]:
    """(model, state, paused for, ...) rows of the breakers."""
    return conn.execute(REPORTS.breaker).fetchall()


def database_state(conn: psycopg.Connection) -> dict[str, Any]:
    """read_only, in_recovery, workers beating and silent."""
    return _dicts(conn, REPORTS.database_state)[0]


def backlog(conn: psycopg.Connection) -> int:
    """Jobs waiting for a worker (pending, retry), every model: what the KEDA trigger reads."""
    return int(queries.scalar(conn, REPORTS.backlog))


@dataclass(frozen=True)
class DocumentSummary:
    document_id: str
    doc_pk: int
    status: str
    source_checksum: str | None  # hex
    text_checksum: str | None  # hex
    extractor_version: str | None
    chunker_version: str | None
    error_class: str | None
    chunks: int
    tokens: int
    chunks_digest: str  # hex sha256 of the chunk checksums in order


@dataclass(frozen=True)
class Coverage:
    wanted: int
    ready: int
    failed: int
    waiting: int


def document_summaries(conn: psycopg.Connection, root: str, document_ids: Sequence[str]) -> dict[str, DocumentSummary]:
    """State of some documents of one source (``root`` as registered: absolute, resolved)."""
    with conn.cursor(row_factory=class_row(DocumentSummary)) as cur:
        rows = cur.execute(REPORTS.document_summaries, {"root": root, "ids": list(document_ids)}).fetchall()
    return {r.document_id: r for r in rows}


def embedding_coverage(
    conn: psycopg.Connection, root: str, document_ids: Sequence[str], model_id: str
) -> tuple[dict[str, Coverage], Coverage]:
    """Per current document, and in total (distinct checksums), the embedding state for a model."""
    per_doc: dict[str, Coverage] = {}
    total = Coverage(0, 0, 0, 0)
    for counts in _dicts(
        conn, REPORTS.embedding_coverage, {"root": root, "ids": list(document_ids), "model": model_id}
    ):
        doc = counts.pop("document_id")
        cov = Coverage(**{name: int(n) for name, n in counts.items()})
        if doc is None:
            total = cov
        else:
            per_doc[doc] = cov
    return per_doc, total


def stale_vectors(conn: psycopg.Connection) -> dict:
    r = _dicts(conn, REPORTS.stale_vectors)[0]
    return {
        "not_ready": int(r["not_ready"]),
        "noncurrent_documents": int(r["noncurrent_documents"]),
        "sample": list(r["sample"] or []),
    }


def dead_letter_growth(conn: psycopg.Connection, window_seconds: float = 3600.0) -> tuple[int, int]:
    """(jobs that became failed within the window, failed jobs in total), neither
    counting the discarded ones (`dlq discard`)."""
    r = _dicts(conn, REPORTS.dead_letter_growth, {"window": window_seconds})[0]
    return int(r["recent"]), int(r["total"])


def dead_letter_discarded(conn: psycopg.Connection) -> int:
    """Failed jobs a person gave up on (`dlq discard`): not in the growth count."""
    return int(_dicts(conn, REPORTS.dead_letter_discarded)[0]["n"])


def sources(conn: psycopg.Connection) -> list[dict]:
    """Each ingested source: its key, kind, documents by status and last complete scan."""
    return _dicts(conn, REPORTS.sources)


def _dicts(conn: psycopg.Connection, query: str, params: dict | None = None) -> list[dict]:
    """The rows of one statement, each a dict keyed by column name."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()
