"""Model registry: one row per model_id, with its dimension and an HNSW index.

The dimension comes from the model's configuration or, when unknown, from the
first response. The per-model HNSW index (a partial expression index, since
one column holds vectors of several dimensions) is built when a worker first
finds the queue drained (and by reconcile), so a backfill builds it in bulk
instead of maintaining it one insert at a time. The SQL is in
sql/queries/models.sql; the index DDL is a psycopg.sql template there.
"""

from __future__ import annotations

import hashlib

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pipeline_assets.providers import ModelSpec
from pipeline_assets.store import queries

MODELS = queries.load("models")
JOBS = queries.load("jobs")


def _index_name(model_id: str) -> str:
    return "embeddings_hnsw_" + hashlib.sha1(model_id.encode()).hexdigest()[:12]


def ensure_model(conn: psycopg.Connection, spec: ModelSpec) -> bool:
    """Register (and activate) the model; return True if it was new or re-activated."""
    row = conn.execute(MODELS.insert_model, {
        "model": spec.model_id, "provider": spec.provider, "name": spec.name, "dimension": spec.dimension,
        "max_input_tokens": spec.max_input_tokens}).fetchone()
    reactivated = conn.execute(MODELS.reactivate, {"model": spec.model_id}).rowcount
    if reactivated:
        # Back after `models retire`: its superseded jobs for wanted content return.
        from pipeline_assets.jobs import transitions

        transitions.revive_wanted(conn)
    return row is not None or bool(reactivated)


def model_dimension(conn: psycopg.Connection, model_id: str) -> int | None:
    row = conn.execute(MODELS.dimension, {"model": model_id}).fetchone()
    return row[0] if row else None


def record_dimension(conn: psycopg.Connection, model_id: str, dimension: int) -> None:
    """First response of a model whose dimension was unknown: record it and index it."""
    conn.execute(MODELS.record_dimension, {"dimension": dimension, "model": model_id})


def ensure_index(conn: psycopg.Connection, model_id: str, dimension: int) -> None:
    name = _index_name(model_id)
    if _index_exists(conn, name):
        return
    # Two workers may discover a dimension at once; concurrent CREATE INDEX IF
    # NOT EXISTS can still collide in the catalog, so serialise them.
    with conn.transaction():
        conn.execute(MODELS.lock_index_build, {"name": name})
        if _index_exists(conn, name):
            return
        conn.execute(sql.SQL(MODELS.create_hnsw_index).format(
            name=sql.Identifier(name), dim=sql.Literal(int(dimension)), model=sql.Literal(model_id)))


def _index_exists(conn: psycopg.Connection, name: str) -> bool:
    return conn.execute(MODELS.index_exists, {"name": name}).fetchone() is not None


def resolve_model_id(conn: psycopg.Connection, name: str) -> str | None:
    """Map a configured model name (PIPELINE_EMBEDDING_MODEL) to its model_id."""
    row = conn.execute(MODELS.resolve_model_id, {"name": name}).fetchone()
    return row[0] if row else None


def active_model_ids(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute(MODELS.active_model_ids)]


def list_models(conn: psycopg.Connection) -> list[dict]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(MODELS.list_models).fetchall()


def retire(conn: psycopg.Connection, model_id: str) -> int:
    """Stop wanting vectors of a model after a model change.

    New content is no longer enqueued for it and its unstarted jobs are
    superseded (a late completion is refused: the model is inactive). Its ready
    vectors stay, so ``export --model`` still works and re-activating it (run a
    worker with it) needs no re-embedding of unchanged content.
    """
    with conn.transaction():
        conn.execute(MODELS.deactivate, {"model": model_id})
        return conn.execute(JOBS.supersede_retired_model, {"model": model_id}).rowcount
