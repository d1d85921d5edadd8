"""Reconciliation: how missed events are repaired.

Re-scan every source that was ingested (which replaces changed documents and
tombstones vanished ones), then, set-based: enqueue every current chunk x
active model that has no job, revive superseded jobs whose content is wanted
again, supersede jobs whose content nobody wants, send ready jobs whose vector
is missing back to pending, and rescue expired leases. ``reconcile_all`` also
deletes the vectors and index of models retired longer than the grace period.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import model_admin
from pipeline_assets.app.ingest import ingest_all, register_model
from pipeline_assets.app.runtime import IngestOptions, Runtime
from pipeline_assets.app.source_registry import open_source
from pipeline_assets.content.folder_source import FolderSource
from pipeline_assets.content.source import Source, SourceError
from pipeline_assets.counts import Counts
from pipeline_assets.jobqueue import transitions
from pipeline_assets.store import documents, stage_runs


@dataclass
class ReconcileReport(Counts):
    sources: int = 0
    missing_sources: list[str] = field(default_factory=list)
    changed: int = 0
    new: int = 0
    deleted: int = 0
    enqueued: int = 0
    revived: int = 0
    superseded: int = 0
    repaired_vectors: int = 0
    rescued: int = 0
    purged_models: int = 0  # retired models past PIPELINE_MODEL_RETIRE_GRACE: vectors and index deleted
    purged_vectors: int = 0


def reconcile_all(rt: Runtime, pool: ConnectionPool, *, rescan: bool = True) -> ReconcileReport:
    """`reconcile` and the scheduled reconciliation: register the model, re-scan, repair."""
    with pool.connection() as conn:
        enqueued = register_model(conn, rt)
        report = reconcile(
            conn,
            rt.options,
            model_id=rt.model_id,
            rescan=rescan,
            backoff=(rt.settings.backoff_base, rt.settings.backoff_cap),
            opener=lambda key: open_source(key, rt.settings.source_config()),
        )
    report.enqueued += enqueued
    purged = model_admin.purge_expired(pool, rt.settings.model_retire_grace)
    report.purged_models, report.purged_vectors = len(purged), sum(purged.values())
    return report


def reconcile(
    conn: psycopg.Connection,
    options: IngestOptions,
    *,
    model_id: str | None = None,
    rescan: bool = True,
    backoff: tuple[float, float] = (0.0, 0.0),
    opener: Callable[[str], Source] = FolderSource,
) -> ReconcileReport:
    """``backoff``: (base, cap) of the full-jitter delay a rescued job waits out; ``opener``:
    the source a stored key names (``source_registry.open_source``)."""
    report = ReconcileReport()
    if rescan:
        for root in documents.source_roots(conn):
            try:
                scan = ingest_all(conn, opener(root), options, whole=True)
            except SourceError as exc:
                # A source that vanished entirely or cannot be listed now is reported, never tombstoned.
                report.missing_sources.append(str(exc))
                continue
            report.sources += 1
            report.changed += scan.changed
            report.new += scan.new
            report.deleted += scan.deleted
            report.enqueued += scan.enqueued
            report.revived += scan.revived
            report.superseded += scan.superseded
    with conn.transaction():
        documents.write_lock(conn)
        transitions.drop_orphan_keys(conn)
        report.enqueued += transitions.enqueue_missing(conn, options.config.max_attempts)
        report.revived += transitions.revive_wanted(conn)
        report.superseded += transitions.supersede_unwanted(conn)
        report.repaired_vectors = transitions.repair_missing_vectors(conn)
    rescued = transitions.rescue_expired(conn, base=backoff[0], cap=backoff[1])
    report.rescued = sum(rescued.values())
    if model_id:
        stage_runs.refresh_embed(conn, model_id)
    # No vector index build here: reconcile never waits on one. A worker builds
    # it (concurrently) when its queue drains, `models index` on demand.
    return report
