"""Embedding use cases: run a worker until the queue is idle (or until stopped),
for the whole queue or after enqueueing some documents, and the one-shot
``embed DIR`` (ingest, then work until idle).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from psycopg_pool import ConnectionPool

from pipeline_assets.app import reports, stages
from pipeline_assets.app.ingest import ingest_source, register_model
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.jobs import transitions
from pipeline_assets.jobs.worker import Worker, WorkerConfig, WorkerReport
from pipeline_assets.settings import DEFAULT_CONCURRENCY


def work(rt: Runtime, pool: ConnectionPool, *, concurrency: int = DEFAULT_CONCURRENCY, until_idle: bool = False,
         lease_seconds: float | None = None, worker_id: str | None = None, poll_seconds: float | None = None,
         stop: threading.Event | None = None) -> WorkerReport:
    """Claim and embed until ``stop`` is set (or, ``until_idle``, until nothing is
    claimable, waiting or leased); then refresh the embed stage rows of the documents it touched.

    Raises the worker's FatalProviderError / BudgetExhausted with their one-line messages.
    """
    config = WorkerConfig(concurrency=concurrency, until_idle=until_idle, worker_id=worker_id)
    if lease_seconds:
        config.lease_seconds = lease_seconds
    if poll_seconds:
        config.poll_seconds = poll_seconds
    worker = Worker(pool.conninfo, rt.provider, config, settings=rt.settings, stop_event=stop)
    with pool.connection() as conn:
        since = stages.clock(conn)
    report = worker.run()
    with pool.connection() as conn:
        stages.refresh_embed_touched(conn, rt.model_id, since)
    return report


@dataclass
class DocumentsEmbedded:
    """What embedding some documents of a source did, and their coverage before and after."""

    work: WorkerReport
    enqueued: int
    summaries: dict[str, reports.DocumentSummary]
    before: reports.Coverage
    after: reports.Coverage
    per_document: dict[str, reports.Coverage] = field(default_factory=dict)


def embed_documents(rt: Runtime, pool: ConnectionPool, root: Path, document_ids: Sequence[str], *,
                    poll_seconds: float | None = None) -> DocumentsEmbedded:
    """Make sure the current chunks of some documents have jobs, then work until the queue is idle."""
    root_s = str(root)
    with pool.connection() as conn:
        register_model(conn, rt)
        summaries = reports.document_summaries(conn, root_s, document_ids)
        pks = [s.doc_pk for s in summaries.values() if s.status == "current"]
        enqueued = transitions.enqueue_for_docs(conn, pks, rt.options.max_attempts)
        _, before = reports.embedding_coverage(conn, root_s, document_ids, rt.model_id)
    report = work(rt, pool, until_idle=True, poll_seconds=poll_seconds)
    with pool.connection() as conn:
        stages.refresh_embed_docs(conn, rt.model_id, pks)
        per_doc, after = reports.embedding_coverage(conn, root_s, document_ids, rt.model_id)
    return DocumentsEmbedded(work=report, enqueued=enqueued, summaries=summaries, before=before, after=after,
                             per_document=per_doc)


def embed_directory(rt: Runtime, pool: ConnectionPool, root: Path, *,
                    concurrency: int = DEFAULT_CONCURRENCY, stop: threading.Event | None = None) -> dict:
    """`embed DIR`: ingest the directory, work until idle, and summarise."""
    started = time.monotonic()
    ing = ingest_source(rt, pool, root)
    done = work(rt, pool, concurrency=concurrency, until_idle=True, stop=stop)
    with pool.connection() as conn:
        st = reports.status(conn)
    cov = st["coverage"].get(rt.model_id, {"ready": 0, "wanted": 0})
    return {
        "model": rt.model_id,
        "documents": ing.scanned,
        "documents_changed": ing.new + ing.changed,
        "quarantined": ing.quarantined,
        "deleted": ing.deleted,
        "chunks": ing.chunks,
        "embedded": done.embedded,
        "reused": max(cov["ready"] - done.embedded, 0),
        "failed": st["jobs_by_model"].get(rt.model_id, {}).get("failed", 0),
        "provider_calls": done.provider_calls,
        "coverage": f"{cov['ready']}/{cov['wanted']}",
        "seconds": round(time.monotonic() - started, 2),
    }
