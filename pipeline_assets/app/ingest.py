"""Ingest: list a source (``content.source.Source``), checksum, extract, chunk, enqueue; no
provider calls. Idempotent: an item whose bytes (or the source's token for them, an ETag) and
extractor/chunker versions are unchanged is skipped; a changed item has its chunks replaced and
its new chunks enqueued in one transaction per batch, the jobs of content no longer wanted
superseded at once; items gone from the source are tombstoned after a complete scan. Guards
(``app.ingest_config``): bounded batches, extraction in killable child processes (one per core
by default), a document's failure is its own quarantine (``app.ingest_batches``).
The use cases (``ingest_source``, ``ingest_documents``) are what the command line and the
Dagster assets and sensors call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import document_writes
from pipeline_assets.app.ingest_batches import IngestReport, ingest_items, retrying
from pipeline_assets.app.runtime import IngestOptions, Runtime
from pipeline_assets.content.folder_source import as_source
from pipeline_assets.content.server_process import start_server_soon
from pipeline_assets.content.source import Item, Source, SourceError
from pipeline_assets.jobqueue import running_ingests, transitions
from pipeline_assets.registry import models
from pipeline_assets.store import db, documents

T = TypeVar("T")

# Error class counted in IngestReport.errors for a document id that is refused
# (absolute, '..', hidden, another source's; see Source.id_problem): nothing is read or written.
INVALID_DOCUMENT_ID = "invalid_document_id"


# -- use cases ---------------------------------------------------------------------------
def register_model(conn: psycopg.Connection, rt: Runtime) -> int:
    """Register the runtime's model; a model seen for the first time gets jobs for
    every current chunk ingested before it. Returns the jobs enqueued. A retired
    model is refused (``models.ModelRetired``, one line) until `models activate`."""
    if models.ensure_model(conn, rt.provider.spec):
        return transitions.enqueue_missing(conn, rt.options.config.max_attempts)
    return 0


def ingest_source(rt: Runtime, pool: ConnectionPool, source: Source | Path) -> IngestReport:
    """`ingest SOURCE`: the whole source; documents gone from it are tombstoned. Marked
    running meanwhile (``running_ingests``: no worker builds a vector index until it ends)."""
    start_server_soon()  # the extraction children's server starts while the ingest is set up
    with running_ingests.marked(lambda: db.pool_connect(pool)), pool.connection() as conn:
        enqueued = register_model(conn, rt)
        report = ingest_all(conn, source, rt.options)
    report.enqueued += enqueued
    return report


def ingest_documents(
    rt: Runtime, pool: ConnectionPool, source: Source | Path, document_ids: Iterable[str]
) -> IngestReport:
    """Some documents of a source (Dagster partitions, a rerun, vanished items); marked running
    meanwhile, as ``ingest_source``."""
    start_server_soon()
    with running_ingests.marked(lambda: db.pool_connect(pool)), pool.connection() as conn:
        enqueued = register_model(conn, rt)
        report = ingest_ids(conn, source, document_ids, rt.options)
    report.enqueued += enqueued
    return report


# -- machinery -------------------------------------------------------------------------------
def ingest_all(
    conn: psycopg.Connection, source: Source | Path, options: IngestOptions, *, whole: bool = False
) -> IngestReport:
    """List everything in ``source``; tombstone what is no longer there. A listing that fails
    (SourceError) tombstones nothing: only a complete listing says what is gone. ``whole``
    (a reconciliation): a source with its own change feed compares all of itself instead."""
    source = as_source(source)
    changes = getattr(source, "ingest_changes", None)
    if changes is not None:  # a source that finds its own changes (a table: digest, watermark, change log)
        return changes(conn, options, whole=whole)
    items = source.items()
    scan_started = documents.start_scan(conn)
    first = next(items, None)  # raises SourceError for a missing root, before anything is registered
    source_id = documents.register_source(conn, source)
    report = IngestReport()
    ingest_items(conn, source, source_id, _chain(first, items), options, report, record_seen=True)
    if report.scanned == 0 and not options.allow_empty:
        current = documents.current_count(conn, source_id)
        if current:
            raise SourceError(
                f"source {source.describe()} is empty but {current} documents from it are current; "
                "refusing to tombstone them all (pass --allow-empty if this is intended)"
            )

    def tombstone() -> list[int]:
        with conn.transaction():
            documents.write_lock(conn)
            pks = documents.tombstone_unseen(conn, source_id, scan_started)
            superseded = document_writes.tombstone(conn, pks)
            documents.mark_scanned(conn, source_id)
        return [len(pks), superseded]

    deleted, superseded = retrying(tombstone)
    report.deleted += deleted
    report.superseded += superseded
    return report


def ingest_ids(
    conn: psycopg.Connection, source: Source | Path, document_ids: Iterable[str], options: IngestOptions
) -> IngestReport:
    """Ingest only some documents of a source. An id the source no longer has is tombstoned;
    an id it refuses (absolute, '..', another source's) is counted, never read."""
    source = as_source(source)
    report = IngestReport()
    wanted = []
    for doc_id in document_ids:
        if source.id_problem(doc_id):
            report.errors[INVALID_DOCUMENT_ID] = report.errors.get(INVALID_DOCUMENT_ID, 0) + 1
        else:
            wanted.append(doc_id)
    found = source.lookup(wanted)  # SourceError (unreachable): nothing below happens
    source_id = documents.register_source(conn, source)
    missing = [doc for doc in wanted if doc not in found]
    ingest_items(conn, source, source_id, iter(found.values()), options, report, record_seen=False)
    if missing:

        def tombstone() -> list[int]:
            with conn.transaction():
                documents.write_lock(conn)
                pks = documents.tombstone_ids(conn, source_id, missing)
                return [len(pks), document_writes.tombstone(conn, pks)]

        deleted, superseded = retrying(tombstone)
        report.deleted += deleted
        report.superseded += superseded
    return report


def _chain(first: Item | None, rest: Iterator[Item]) -> Iterator[Item]:
    if first is not None:
        yield first
        yield from rest


# The names older revisions have (benchmarks that compare revisions import them).
ingest_directory = ingest_all
ingest_paths = ingest_ids
