"""Embedding use cases that run a worker: until the queue is idle (or until stopped), and the
one-shot ``embed DIR`` (ingest, then work until idle). Embedding some documents and waiting for
them: app/embed_selection.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from psycopg_pool import ConnectionPool

from pipeline_assets.app import input_limits
from pipeline_assets.app.ingest import ingest_source
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.content.source import Source
from pipeline_assets.counts import Counts
from pipeline_assets.jobqueue.faults import DatabaseWait, database_unavailable
from pipeline_assets.jobqueue.worker import Worker, WorkerReport
from pipeline_assets.jobqueue.worker_config import DEFAULT_CONCURRENCY
from pipeline_assets.messages import one_line
from pipeline_assets.store import db, reports, stage_runs, text_search

log = logging.getLogger(__name__)

# How long a finished work run waits for an unavailable database to record the
# embed stage of the documents it touched (reconcile records them otherwise).
STAGE_RECORD_WAIT_SECONDS = 60.0


def work(
    rt: Runtime,
    pool: ConnectionPool,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    until_idle: bool = False,
    lease_seconds: float | None = None,
    worker_id: str | None = None,
    poll_seconds: float | None = None,
    stop_event: threading.Event | None = None,
    observe: Callable[[Worker], None] | None = None,
) -> WorkerReport:
    """Claim and embed until ``stop_event`` is set (or, ``until_idle``, until nothing is
    claimable, waiting or leased); the embed stage rows of the documents it touched are written
    when its queue drains (beside the index build) and brought up to date when it ends.

    Raises the worker's FatalProviderError / BudgetExhausted with their one-line messages.
    """
    # Worker start: the chunk size must fit this model's and every active model's window.
    input_limits.check_input_limits(rt.settings, pool, rt.provider.spec)
    config = rt.settings.worker_config(
        concurrency=concurrency,
        until_idle=until_idle,
        worker_id=worker_id,
        lease_seconds=lease_seconds or None,
        poll_seconds=poll_seconds or None,
    )
    with pool.connection() as conn:
        since = stage_runs.clock(conn)
    # The stage rows are written at the drain, beside the index build; here only what changed since.
    worker = Worker(db.pool_url(pool), rt.provider, config, stop_event=stop_event, stages_since=since)
    if observe is not None:  # metrics and progress read its report while it runs
        observe(worker)
    report = worker.run()
    _record_touched(pool, rt.model_id, worker.stages_until or since)
    return report


def _record_touched(pool: ConnectionPool, model_id: str, since: datetime) -> None:
    """Store the embed stage rows of the documents a run touched; an unavailable database
    (unreachable, read-only) is waited for a while, then left to reconcile."""

    def record() -> None:
        with pool.connection() as conn:
            stage_runs.refresh_embed_touched(conn, model_id, since)

    try:
        pool.check()  # connections the database ended while the run went on are replaced first
        DatabaseWait(on_unavailable=pool.drain).ride_out(
            record, threading.Event(), give_up_after=STAGE_RECORD_WAIT_SECONDS
        )
    except Exception as exc:
        if not database_unavailable(exc):
            raise
        log.warning(
            "could not record the embed stage of the documents this run touched (the database is "
            "unavailable: %s); `reconcile` records them",
            one_line(exc),
        )


@dataclass
class DirectoryEmbedded(Counts):
    """What `embed DIR` did (its summary line and JSON)."""

    model: str
    documents: int  # scanned
    documents_changed: int  # new or changed
    quarantined: int
    deleted: int
    chunks: int
    embedded: int  # vectors stored by this run
    reused: int  # ready vectors it did not have to make
    failed: int  # the model's dead-lettered jobs
    provider_calls: int
    coverage: str  # "ready/wanted" for the model
    seconds: float


def embed_directory(
    rt: Runtime,
    pool: ConnectionPool,
    root: Source | Path,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    stop_event: threading.Event | None = None,
    observe: Callable[[Worker], None] | None = None,
) -> DirectoryEmbedded:
    """`embed SOURCE`: ingest the source, work until idle, and summarise."""
    started = time.monotonic()
    input_limits.check_input_limits(rt.settings, pool, rt.provider.spec)  # before the ingest, not after
    # The chunks' text-search vectors are computed by the worker from its first beat, beside the
    # sending (again when its queue drains); what a worker stopped early left, here
    # (not once stopped by a signal: the next ingest or drain computes them; search reads the text).
    ing = ingest_source(
        dataclasses.replace(rt, options=dataclasses.replace(rt.options, text_search_later=True)), pool, root
    )
    done = work(rt, pool, concurrency=concurrency, until_idle=True, stop_event=stop_event, observe=observe)
    with pool.connection() as conn:
        text_search.fill(conn, stop_event)
    with pool.connection() as conn:
        coverage, jobs = reports.coverage_by_model(conn), reports.jobs_by_model(conn)
    cov = coverage.get(rt.model_id, {"ready": 0, "wanted": 0})
    return DirectoryEmbedded(
        model=rt.model_id,
        documents=ing.scanned,
        documents_changed=ing.new + ing.changed,
        quarantined=ing.quarantined,
        deleted=ing.deleted,
        chunks=ing.chunks,
        embedded=done.embedded,
        reused=max(int(cov["ready"]) - done.embedded, 0),
        failed=jobs.get(rt.model_id, {}).get("failed", 0),
        provider_calls=done.provider_calls,
        coverage=f"{int(cov['ready'])}/{int(cov['wanted'])}",
        seconds=round(time.monotonic() - started, 2),
    )
