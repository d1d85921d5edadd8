"""Status, as the command line and Dagster report it (the dead-letter queue: app/dlq.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import input_limits
from pipeline_assets.counts import Counts
from pipeline_assets.jobqueue.status import JobStatus
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings
from pipeline_assets.store import reports, stage_runs


@dataclass
class StatusReport(Counts):
    """What `status` shows. The per-model and per-status maps are keyed by model id
    and status name; the last fields are filled by ``status``."""

    documents: dict[str, int]  # by document status
    jobs: dict[str, int]  # by job status, every model
    jobs_by_model: dict[str, dict[str, int]]
    stages: dict[str, dict[str, int]]  # stage -> status -> documents
    embed_by_model: dict[str, dict[str, int]]
    coverage: dict[str, dict[str, float]]  # model -> ready, wanted, ratio
    dead_letter: int
    dead_letter_discarded: int  # of those, given up on (`dlq discard`)
    superseded: int
    quarantined_documents: int
    spend: dict[str, dict[str, int]]  # model -> calls, tokens, inputs, duplicate sends
    breaker: dict[str, dict[str, Any]]  # model -> the provider breaker's state
    vector_index: dict[str, Any] = field(default_factory=dict)  # per active model: hnsw, building...
    vector_index_builds: dict[str, Any] = field(default_factory=dict)  # per model building: its progress
    served_model: str | None = None  # what search and export read
    retired_models: dict[str, dict[str, Any]] = field(default_factory=dict)
    input_limits: list[dict[str, Any]] = field(default_factory=list)
    retry_after_cap: float | None = None
    database: dict[str, Any] = field(default_factory=dict)  # read_only, in_recovery, workers beating/silent
    backlog: int = 0  # pending + retry, every model: what the KEDA trigger reads
    sources: list[dict[str, Any]] = field(default_factory=list)  # each source: key, kind, documents, last scan
    watched_source: str | None = None  # what the Dagster sensor watches


def database_status(conn: psycopg.Connection) -> StatusReport:
    """What the database alone says: jobs, stages, coverage, dead letters, spend, breakers."""
    jobs = reports.jobs_by_model(conn)
    stages = reports.stage_counts(conn)
    # The embed stage is computed from the jobs here, never stored by a read.
    embed, embed_by_model = stage_runs.embed_counts(conn)
    if embed:
        stages["embed"] = embed
    totals: dict[str, int] = {}
    for per_model in jobs.values():
        for st, n in per_model.items():
            totals[st] = totals.get(st, 0) + n
    return StatusReport(
        documents=reports.documents_by_status(conn),
        jobs=totals,
        jobs_by_model=jobs,
        stages=stages,
        embed_by_model=embed_by_model,
        coverage=reports.coverage_by_model(conn),
        dead_letter=totals.get(JobStatus.FAILED, 0),
        dead_letter_discarded=reports.dead_letter_discarded(conn),
        superseded=totals.get(JobStatus.SUPERSEDED, 0),
        quarantined_documents=reports.quarantined_count(conn),
        spend=reports.spend(conn),
        breaker=reports.breaker(conn),
        database=reports.database_state(conn),
        backlog=reports.backlog(conn),
    )


def status(pool: ConnectionPool, settings: Settings) -> StatusReport:
    """Jobs by status and model, stages, coverage, dead letters, spend, indexes, input
    limits. Read-only: it writes nothing (the embed stage is computed from the jobs in
    the read query), so a role with only SELECT can run it."""
    with pool.connection() as conn:
        report = database_status(conn)
        report.vector_index, report.vector_index_builds = models.index_states(conn)
        report.served_model = models.served_model_id(conn)
        report.sources = reports.sources(conn)
        report.retired_models = {
            r.pop("model_id"): {k: r[k] for k in ("retired_at", "purge_after", "purged_at")}
            for r in models.model_states(conn, settings.model_retire_grace)
            if not r["active"]
        }
    report.input_limits = input_limits.by_active_model(pool)  # per active model: window, oversize chunks, truncation
    report.retry_after_cap = settings.retry_after_cap
    report.watched_source = settings.source or settings.source_dir
    return report
