"""Status and the dead-letter queue, as the command line and Dagster report them."""

from __future__ import annotations

from typing import Sequence

from psycopg_pool import ConnectionPool

from pipeline_assets.app import reports
from pipeline_assets.jobs import models, transitions


def status(pool: ConnectionPool) -> dict:
    """Jobs by status and model, stages, coverage, dead letters, spend. Read-only: it
    writes nothing (the embed stage is computed from the jobs in the read query), so
    a role with only SELECT can run it."""
    with pool.connection() as conn:
        data = reports.status(conn)
        data["vector_index"] = models.index_states(conn)  # per active model: hnsw, building, exact search...
        return data


def dead_letters(pool: ConnectionPool) -> list[dict]:
    with pool.connection() as conn:
        return reports.dead_letters(conn)


def requeue(pool: ConnectionPool, job_ids: Sequence[int] = (), *, all_failed: bool = False) -> dict[str, int]:
    """Send dead letters back to pending (superseded when their content is no longer wanted)."""
    with pool.connection() as conn:
        return transitions.requeue_failed(conn, job_ids, all_failed=all_failed)
