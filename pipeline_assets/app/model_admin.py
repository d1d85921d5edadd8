"""Model use cases: resolve a configured name, list models, retire one after a model change."""

from __future__ import annotations

from psycopg_pool import ConnectionPool

from pipeline_assets.jobs import models
from pipeline_assets.providers import ConfigError


def resolve(pool: ConnectionPool, name: str) -> str:
    """The model_id of a model name or id known to the database (ConfigError if unknown)."""
    with pool.connection() as conn:
        model_id = models.resolve_model_id(conn, name)
    if model_id is None:
        raise ConfigError(f"unknown model {name!r}")
    return model_id


def list_models(pool: ConnectionPool) -> list[dict]:
    with pool.connection() as conn:
        return models.list_models(conn)


def retire(pool: ConnectionPool, name: str) -> tuple[str, int]:
    """Stop embedding new content with a model; returns (model_id, unstarted jobs superseded)."""
    model_id = resolve(pool, name)
    with pool.connection() as conn:
        return model_id, models.retire(conn, model_id)
