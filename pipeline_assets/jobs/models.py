"""Model registry: one row per model_id, with its dimension and an HNSW index.

The dimension comes from the model's configuration or, when unknown, from the
first response. The per-model HNSW index (a partial expression index, since
one column holds vectors of several dimensions) is built when a worker first
finds the queue drained (and by reconcile), so a backfill builds it in bulk
instead of maintaining it one insert at a time.
"""

from __future__ import annotations

import hashlib

import psycopg

from pipeline_assets.providers import ModelSpec


def _index_name(model_id: str) -> str:
    return "embeddings_hnsw_" + hashlib.sha1(model_id.encode()).hexdigest()[:12]


def ensure_model(conn: psycopg.Connection, spec: ModelSpec) -> bool:
    """Register (and activate) the model; return True if it was new or re-activated."""
    row = conn.execute(
        "INSERT INTO app.models (model_id, provider, name, dimension, max_input_tokens)"
        " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (model_id) DO NOTHING RETURNING model_id",
        (spec.model_id, spec.provider, spec.name, spec.dimension, spec.max_input_tokens),
    ).fetchone()
    reactivated = conn.execute("UPDATE app.models SET active = true WHERE model_id = %s AND NOT active",
                               (spec.model_id,)).rowcount
    if reactivated:
        # Back after `models retire`: its superseded jobs for wanted content return.
        from pipeline_assets.jobs import transitions

        transitions.revive_wanted(conn)
    return row is not None or bool(reactivated)


def model_dimension(conn: psycopg.Connection, model_id: str) -> int | None:
    row = conn.execute("SELECT dimension FROM app.models WHERE model_id = %s", (model_id,)).fetchone()
    return row[0] if row else None


def record_dimension(conn: psycopg.Connection, model_id: str, dimension: int) -> None:
    """First response of a model whose dimension was unknown: record it and index it."""
    conn.execute("UPDATE app.models SET dimension = %s WHERE model_id = %s AND dimension IS NULL",
                 (dimension, model_id))


def ensure_index(conn: psycopg.Connection, model_id: str, dimension: int) -> None:
    name = _index_name(model_id)
    if _index_exists(conn, name):
        return
    literal = model_id.replace("'", "''")
    # Two workers may discover a dimension at once; concurrent CREATE INDEX IF
    # NOT EXISTS can still collide in the catalog, so serialise them.
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (name,))
        if _index_exists(conn, name):
            return
        conn.execute(
            f"CREATE INDEX {name} ON app.embeddings"
            f" USING hnsw ((embedding::vector({int(dimension)})) vector_cosine_ops)"
            f" WHERE model_id = '{literal}'"
        )


def _index_exists(conn: psycopg.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM pg_indexes WHERE schemaname = 'app' AND indexname = %s",
                        (name,)).fetchone() is not None


def resolve_model_id(conn: psycopg.Connection, name: str) -> str | None:
    """Map a configured model name (PIPELINE_EMBEDDING_MODEL) to its model_id."""
    row = conn.execute(
        "SELECT model_id FROM app.models WHERE name = %s OR model_id = %s ORDER BY active DESC, created_at DESC LIMIT 1",
        (name, name),
    ).fetchone()
    return row[0] if row else None


def list_models(conn: psycopg.Connection) -> list[dict]:
    rows = conn.execute(
        """SELECT m.model_id, m.name, m.provider, m.dimension, m.active,
                  count(j.job_id) FILTER (WHERE j.status = 'ready') AS ready,
                  count(j.job_id) FILTER (WHERE j.status IN ('pending', 'retry', 'processing')) AS outstanding
           FROM app.models m LEFT JOIN app.embedding_jobs j ON j.model_id = m.model_id
           GROUP BY m.model_id ORDER BY m.created_at""").fetchall()
    return [{"model_id": r[0], "name": r[1], "provider": r[2], "dimension": r[3], "active": r[4],
             "ready": r[5], "outstanding": r[6]} for r in rows]


def retire(conn: psycopg.Connection, model_id: str) -> int:
    """Stop wanting vectors of a model after a model change.

    New content is no longer enqueued for it and its unstarted jobs are
    superseded (a late completion is refused: the model is inactive). Its ready
    vectors stay, so ``export --model`` still works and re-activating it (run a
    worker with it) needs no re-embedding of unchanged content.
    """
    with conn.transaction():
        conn.execute("UPDATE app.models SET active = false WHERE model_id = %s", (model_id,))
        return conn.execute(
            "UPDATE app.embedding_jobs SET status = 'superseded', updated_at = now()"
            " WHERE model_id = %s AND status IN ('pending', 'retry')", (model_id,)).rowcount
