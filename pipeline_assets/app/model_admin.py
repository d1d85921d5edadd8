"""Model use cases: resolve a configured name, list models, retire one after a
model change, activate a retired one again, build a model's vector index."""

from __future__ import annotations

from psycopg_pool import ConnectionPool

from pipeline_assets.app import documents
from pipeline_assets.jobs import models, vector_index
from pipeline_assets.jobs.vector_index import IndexBuildError  # noqa: F401 - what build_index raises
from pipeline_assets.providers import ConfigError
from pipeline_assets.store import db


def resolve(pool: ConnectionPool, name: str) -> str:
    """The model_id of a model name or id known to the database (ConfigError if unknown)."""
    with pool.connection() as conn:
        model_id = models.resolve_model_id(conn, name)
    if model_id is None:
        raise ConfigError(f"unknown model {name!r}")
    return model_id


def list_models(pool: ConnectionPool) -> list[dict]:
    """Every model with its job counts and its index state (``index``: see ``jobs.vector_index``)."""
    with pool.connection() as conn:
        rows = models.list_models(conn)
    for row in rows:
        row["index_detail"] = vector_index.describe(row["index"], row["dimension"])
    return rows


def retire(pool: ConnectionPool, name: str) -> tuple[str, int]:
    """Stop embedding new content with a model; returns (model_id, unstarted jobs superseded)."""
    model_id = resolve(pool, name)
    with pool.connection() as conn:
        return model_id, models.retire(conn, model_id)


def activate(pool: ConnectionPool, name: str, *, max_attempts: int) -> dict:
    """Undo `models retire`: workers and ingests may use the model again.

    Returns the model id, whether it was retired, and the jobs revived and
    enqueued for content it now lacks (what the next worker will bill).
    """
    model_id = resolve(pool, name)
    with pool.connection() as conn, conn.transaction():
        documents.write_lock(conn)  # as reconcile's repairs: no ingest replaces chunks meanwhile
        was_retired, revived, enqueued = models.activate(conn, model_id, max_attempts)
    return {"model_id": model_id, "was_retired": was_retired, "revived": revived, "enqueued": enqueued}


def build_index(pool: ConnectionPool, name: str) -> dict:
    """Build a model's vector index now (concurrently: completions keep committing).

    On its own connection, outside any transaction. Raises
    ``vector_index.IndexBuildError`` (one line) when the database refuses it.
    """
    model_id = resolve(pool, name)
    with pool.connection() as conn:
        dimension = models.model_dimension(conn, model_id)
    if not dimension:
        return {"model_id": model_id, "index": vector_index.NO_VECTORS,
                "detail": vector_index.describe(vector_index.NO_VECTORS, None)}
    with db.connect(pool.conninfo) as conn:
        outcome = vector_index.build(conn, model_id, int(dimension))
    return {"model_id": model_id, "index": outcome, "detail": vector_index.describe(outcome, int(dimension))}
