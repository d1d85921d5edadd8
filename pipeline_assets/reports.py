"""Read-only views for people: status, dead-letter queue, spend."""

from __future__ import annotations

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
