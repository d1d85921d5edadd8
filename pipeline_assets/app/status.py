"""Status, as the command line and Dagster report it (the dead-letter queue: app/dlq.py)."""

from __future__ import annotations

from psycopg_pool import ConnectionPool

from pipeline_assets.app import reports
from pipeline_assets.jobs import models
from pipeline_assets.settings import Settings


def status(pool: ConnectionPool, model_retire_grace: float = Settings.model_retire_grace) -> dict:
    """Jobs by status and model, stages, coverage, dead letters, spend. Read-only: it
    writes nothing (the embed stage is computed from the jobs in the read query), so
    a role with only SELECT can run it."""
    with pool.connection() as conn:
        data = reports.status(conn)
        data["vector_index"] = models.index_states(conn)  # per active model: hnsw, building, exact search...
        data["served_model"] = models.served_model_id(conn)  # what search and export read
        data["retired_models"] = {r.pop("model_id"): {k: r[k] for k in ("retired_at", "purge_after", "purged_at")}
                                  for r in models.model_states(conn, model_retire_grace) if not r["active"]}
        return data

