"""Status, as the command line and Dagster report it (the dead-letter queue: app/dlq.py)."""

from __future__ import annotations

from psycopg_pool import ConnectionPool

from pipeline_assets.app import model_admin, reports
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings


def status(pool: ConnectionPool, settings: Settings) -> reports.StatusReport:
    """Jobs by status and model, stages, coverage, dead letters, spend, indexes, input
    limits. Read-only: it writes nothing (the embed stage is computed from the jobs in
    the read query), so a role with only SELECT can run it."""
    with pool.connection() as conn:
        report = reports.status(conn)
        report.vector_index, report.vector_index_builds = models.index_states(conn)
        report.served_model = models.served_model_id(conn)
        report.sources = reports.sources(conn)
        report.retired_models = {r.pop("model_id"): {k: r[k] for k in ("retired_at", "purge_after", "purged_at")}
                                 for r in models.model_states(conn, settings.model_retire_grace)
                                 if not r["active"]}
    report.input_limits = model_admin.input_limits(pool)  # per active model: window, oversize chunks, truncation
    report.retry_after_cap = settings.retry_after_cap
    report.watched_source = settings.source or settings.source_dir
    return report
