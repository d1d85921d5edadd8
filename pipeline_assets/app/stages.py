"""Per-item stage state (app.stage_runs) and the partial-rerun query.

extract and chunk rows are written by ingest as it runs. The embed row of a
document is derived from its jobs for a model, refreshed set-based (one
statement, no loop over rows) at the end of a work run, by reconcile and by
status.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg.rows import class_row

from pipeline_assets.store import queries

STAGE_RUNS = queries.load("stage_runs")


@dataclass(frozen=True)
class RerunTarget:
    root: str
    document_id: str
    stage: str
    status: str
    error_class: str | None
    code_version: str | None


def refresh_embed(conn: psycopg.Connection, model_id: str) -> int:
    return conn.execute(STAGE_RUNS.refresh_embed, {"model": model_id}).rowcount


def rerun_targets(conn: psycopg.Connection, *, stage: str, error_class: str | None = None,
                  not_version: str | None = None, failed_only: bool = False,
                  limit: int = 1_000_000) -> list[RerunTarget]:
    with conn.cursor(row_factory=class_row(RerunTarget)) as cur:
        return cur.execute(STAGE_RUNS.rerun_targets, {"stage": stage, "error_class": error_class,
                                                      "not_version": not_version, "failed_only": failed_only,
                                                      "limit": limit}).fetchall()
