"""Read-only views for people: status, dead-letter queue, spend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import psycopg

STATUS_BY_MODEL = """
SELECT model_id, status, count(*) FROM app.embedding_jobs GROUP BY model_id, status ORDER BY 1, 2
"""

STAGES = "SELECT stage, status, count(*) FROM app.stage_runs GROUP BY stage, status ORDER BY 1, 2"

DOCUMENTS = "SELECT status, count(*) FROM app.documents GROUP BY status ORDER BY 1"

# Wanted = distinct checksums of current chunks (per active model); ready = those with a vector.
COVERAGE = """
SELECT m.model_id,
       (SELECT count(DISTINCT c.chunk_checksum) FROM app.chunks c) AS wanted,
       (SELECT count(*) FROM (SELECT DISTINCT c.chunk_checksum FROM app.chunks c) w
        WHERE EXISTS (SELECT 1 FROM app.embeddings e
                      WHERE e.chunk_checksum = w.chunk_checksum AND e.model_id = m.model_id)) AS ready
FROM app.models m WHERE m.active ORDER BY m.model_id
"""

SPEND = """
SELECT model_id, count(*) AS calls, coalesce(sum(tokens), 0) AS tokens,
       coalesce(sum(inputs) FILTER (WHERE outcome = 'ok'), 0) AS inputs_ok,
       count(*) FILTER (WHERE outcome <> 'ok') AS failed_calls
FROM app.provider_calls GROUP BY model_id ORDER BY model_id
"""

DUPLICATE_SENDS = """
SELECT model_id, count(*) FILTER (WHERE sends > 1) AS inputs_sent_more_than_once,
       coalesce(sum(sends - 1), 0) AS extra_sends
FROM app.input_sends GROUP BY model_id ORDER BY model_id
"""

DLQ = """
SELECT j.job_id, j.model_id, j.error_class, j.error_message, j.attempts, j.updated_at,
       (SELECT array_agg(DISTINCT d.document_id ORDER BY d.document_id)
        FROM app.chunks c JOIN app.documents d ON d.doc_pk = c.doc_pk
        WHERE c.chunk_checksum = j.chunk_checksum) AS documents
FROM app.embedding_jobs j WHERE j.status = 'failed' ORDER BY j.updated_at, j.job_id
"""

QUARANTINED = """
SELECT d.document_id, src.root, d.error_class, d.error_message, d.updated_at
FROM app.documents d JOIN app.sources src USING (source_id)
WHERE d.status = 'quarantined' ORDER BY d.document_id
"""


def status(conn: psycopg.Connection) -> dict:
    jobs: dict[str, dict[str, int]] = {}
    for model, st, n in conn.execute(STATUS_BY_MODEL):
        jobs.setdefault(model, {})[st] = n
    stages_: dict[str, dict[str, int]] = {}
    for stage, st, n in conn.execute(STAGES):
        stages_.setdefault(stage, {})[st] = n
    coverage = {m: {"ready": r, "wanted": w, "ratio": (r / w if w else 1.0)}
                for m, w, r in conn.execute(COVERAGE)}
    spend = {m: {"calls": c, "tokens": t, "inputs_ok": i, "failed_calls": f}
             for m, c, t, i, f in conn.execute(SPEND)}
    for m, dup, extra in conn.execute(DUPLICATE_SENDS):
        spend.setdefault(m, {"calls": 0, "tokens": 0, "inputs_ok": 0, "failed_calls": 0})
        spend[m]["duplicate_inputs"] = dup
        spend[m]["extra_sends"] = extra
    totals: dict[str, int] = {}
    for per_model in jobs.values():
        for st, n in per_model.items():
            totals[st] = totals.get(st, 0) + n
    return {
        "documents": dict(conn.execute(DOCUMENTS).fetchall()),
        "jobs": totals,
        "jobs_by_model": jobs,
        "stages": stages_,
        "coverage": coverage,
        "dead_letter": totals.get("failed", 0),
        "superseded": totals.get("superseded", 0),
        "quarantined_documents": conn.execute(
            "SELECT count(*) FROM app.documents WHERE status = 'quarantined'").fetchone()[0],
        "spend": spend,
    }


def dead_letters(conn: psycopg.Connection) -> list[dict]:
    items = [
        {"kind": "job", "id": jid, "model": model, "error_class": cls, "message": msg, "attempts": att,
         "failed_at": at.isoformat(), "documents": docs or []}
        for jid, model, cls, msg, att, at, docs in conn.execute(DLQ)
    ]
    items += [
        {"kind": "document", "id": doc, "source": root, "error_class": cls, "message": msg,
         "failed_at": at.isoformat(), "documents": [doc]}
        for doc, root, cls, msg, at in conn.execute(QUARANTINED)
    ]
    return items


# ---------------------------------------------------------------------------
# Per-document and health read models (added for the Dagster layer, issue 3).
# Read-only, set-based; the Dagster assets, sensors and checks report from
# these and hold no SQL of their own.
# ---------------------------------------------------------------------------

# One row per requested document of a source: its state, versions and a digest
# of its current chunk checksums in chunk order (the chunks' data version).
DOCUMENT_SUMMARIES = """
SELECT d.document_id, d.doc_pk, d.status, d.source_checksum, d.text_checksum, d.extractor_version,
       d.chunker_version, d.error_class, count(c.chunk_index) AS chunks,
       coalesce(sum(c.token_count), 0) AS tokens,
       sha256(coalesce(string_agg(c.chunk_checksum, ''::bytea ORDER BY c.chunk_index), ''::bytea)) AS digest
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
LEFT JOIN app.chunks c ON c.doc_pk = d.doc_pk
WHERE s.root = %(root)s AND d.document_id = ANY(%(ids)s)
GROUP BY d.doc_pk
"""

# Embedding state of the distinct chunk checksums of some documents for one
# model; the grouping-set row with document_id NULL is the distinct total.
EMBEDDING_COVERAGE = """
SELECT d.document_id,
       count(DISTINCT c.chunk_checksum) AS wanted,
       count(DISTINCT c.chunk_checksum) FILTER (WHERE j.status = 'ready' AND e.chunk_checksum IS NOT NULL) AS ready,
       count(DISTINCT c.chunk_checksum) FILTER (WHERE j.status = 'failed') AS failed,
       count(DISTINCT c.chunk_checksum) FILTER (WHERE j.job_id IS NULL
                                                   OR j.status IN ('pending', 'retry', 'processing')) AS waiting
FROM app.documents d
JOIN app.sources s ON s.source_id = d.source_id
JOIN app.chunks c ON c.doc_pk = d.doc_pk
LEFT JOIN app.job_keys k ON k.chunk_checksum = c.chunk_checksum AND k.model_id = %(model)s
LEFT JOIN app.embedding_jobs j ON j.job_id = k.job_id
LEFT JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %(model)s
WHERE s.root = %(root)s AND d.document_id = ANY(%(ids)s) AND d.status = 'current'
GROUP BY GROUPING SETS ((d.document_id), ())
"""

# Every distinct current chunk x active model: how many lack a ready job with its vector.
MISSING_EMBEDDINGS = """
WITH wanted AS (
    SELECT DISTINCT c.chunk_checksum FROM app.chunks c
    JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current')
SELECT m.model_id,
       (SELECT count(*) FROM wanted) AS wanted,
       (SELECT count(*) FROM wanted w WHERE NOT EXISTS (
            SELECT 1 FROM app.job_keys k
            JOIN app.embedding_jobs j ON j.job_id = k.job_id AND j.status = 'ready'
            JOIN app.embeddings e ON e.chunk_checksum = k.chunk_checksum AND e.model_id = k.model_id
            WHERE k.chunk_checksum = w.chunk_checksum AND k.model_id = m.model_id)) AS missing,
       (SELECT count(*) FROM wanted w
            JOIN app.job_keys k ON k.chunk_checksum = w.chunk_checksum AND k.model_id = m.model_id
            JOIN app.embedding_jobs j ON j.job_id = k.job_id AND j.status = 'failed') AS failed
FROM app.models m WHERE m.active ORDER BY m.model_id
"""

# Vectors that must not be current: stored without a ready job (superseded,
# failed, pending...), or reachable from a document that is not current.
STALE_VECTORS = """
SELECT
  (SELECT count(*) FROM app.embeddings e WHERE NOT EXISTS (
       SELECT 1 FROM app.job_keys k JOIN app.embedding_jobs j ON j.job_id = k.job_id AND j.status = 'ready'
       WHERE k.chunk_checksum = e.chunk_checksum AND k.model_id = e.model_id)),
  (SELECT count(*) FROM app.chunks c
   JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status <> 'current'
   JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum),
  (SELECT array_agg(x) FROM (
       SELECT e.model_id || ':' || encode(e.chunk_checksum, 'hex') AS x FROM app.embeddings e
       WHERE NOT EXISTS (SELECT 1 FROM app.job_keys k JOIN app.embedding_jobs j
                         ON j.job_id = k.job_id AND j.status = 'ready'
                         WHERE k.chunk_checksum = e.chunk_checksum AND k.model_id = e.model_id)
       ORDER BY 1 LIMIT 5) s)
"""

# Growth of the dead-letter queue: jobs that became 'failed' within a window, and the depth.
DEAD_LETTER_GROWTH = """
SELECT count(*) FILTER (WHERE updated_at > now() - make_interval(secs => %(window)s)), count(*)
FROM app.embedding_jobs WHERE status = 'failed'
"""


@dataclass(frozen=True)
class DocumentSummary:
    document_id: str
    doc_pk: int
    status: str
    source_checksum: str | None   # hex
    text_checksum: str | None     # hex
    extractor_version: str | None
    chunker_version: str | None
    error_class: str | None
    chunks: int
    tokens: int
    chunks_digest: str            # hex sha256 of the chunk checksums in order


@dataclass(frozen=True)
class Coverage:
    wanted: int
    ready: int
    failed: int
    waiting: int


def _hex(value: bytes | None) -> str | None:
    return value.hex() if value is not None else None


def document_summaries(conn: psycopg.Connection, root: str,
                       document_ids: Sequence[str]) -> dict[str, DocumentSummary]:
    """State of some documents of one source (``root`` as registered: absolute, resolved)."""
    rows = conn.execute(DOCUMENT_SUMMARIES, {"root": root, "ids": list(document_ids)})
    return {r[0]: DocumentSummary(r[0], r[1], r[2], _hex(r[3]), _hex(r[4]), r[5], r[6], r[7], int(r[8]),
                                  int(r[9]), r[10].hex())
            for r in rows}


def embedding_coverage(conn: psycopg.Connection, root: str, document_ids: Sequence[str],
                       model_id: str) -> tuple[dict[str, Coverage], Coverage]:
    """Per current document, and in total (distinct checksums), the embedding state for a model."""
    per_doc: dict[str, Coverage] = {}
    total = Coverage(0, 0, 0, 0)
    for doc, *counts in conn.execute(EMBEDDING_COVERAGE, {"root": root, "ids": list(document_ids),
                                                          "model": model_id}):
        cov = Coverage(*(int(n) for n in counts))
        if doc is None:
            total = cov
        else:
            per_doc[doc] = cov
    return per_doc, total


def missing_embeddings(conn: psycopg.Connection) -> dict[str, dict[str, int]]:
    """Per active model: distinct current chunks wanted, missing a ready vector, and failed."""
    return {m: {"wanted": int(w), "missing": int(x), "failed": int(f)}
            for m, w, x, f in conn.execute(MISSING_EMBEDDINGS)}


def stale_vectors(conn: psycopg.Connection) -> dict:
    not_ready, noncurrent, sample = conn.execute(STALE_VECTORS).fetchone()
    return {"not_ready": int(not_ready), "noncurrent_documents": int(noncurrent), "sample": list(sample or [])}


def dead_letter_growth(conn: psycopg.Connection, window_seconds: float = 3600.0) -> tuple[int, int]:
    """(jobs that became failed within the window, failed jobs in total)."""
    recent, total = conn.execute(DEAD_LETTER_GROWTH, {"window": window_seconds}).fetchone()
    return int(recent), int(total)
