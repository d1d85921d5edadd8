"""Ingest: list a source (``content.source.Source``), checksum, extract, chunk, enqueue.
No provider calls.

Idempotent: an item whose raw bytes and extractor/chunker versions are unchanged
is skipped (a duplicate event creates no work); where the source's token vouches
for the bytes (an ETag), an item with its stored token is not even read. A changed item has its chunks
replaced and its new chunks enqueued in one transaction per batch, and the
jobs of content no longer wanted are superseded at once. Items gone from the
source are tombstoned after a complete scan.

Guards (``app.ingest_config``): one transaction holds at most ``batch_documents`` documents and,
past ``batch_bytes`` of chunk text, is written at once; extraction
runs in a bounded pool of child processes (``content.process.Extractor``,
PIPELINE_EXTRACT_PROCESSES: one per usable core by default) and the transactions in a thread of
their own (``app.ingest_writes``), so reading, extracting and writing overlap; every failure of one
document is that document's quarantine; a transaction the server aborts for a
deadlock is retried (TX_ATTEMPTS) instead of aborting the ingest or reconcile.

The use cases (``ingest_source``, ``ingest_documents``) are what the command
line and the Dagster assets and sensors call; the rest is their machinery.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import document_writes
from pipeline_assets.app.ingest_writes import DatabaseThread
from pipeline_assets.app.runtime import IngestOptions, Runtime
from pipeline_assets.content.folder_source import as_source
from pipeline_assets.content.process import Extractor, ExtractSpec, KnownDocument, Processed, process_items
from pipeline_assets.content.server_process import start_server_soon
from pipeline_assets.content.source import Item, Source, SourceError
from pipeline_assets.counts import Counts
from pipeline_assets.jobs import running_ingests, transitions
from pipeline_assets.registry import models
from pipeline_assets.store import db, documents, text_search

T = TypeVar("T")

# Attempts of one ingest transaction that the server aborted to break a deadlock
# or a serialization conflict (with another ingest, a reconcile, a person's
# statement), before the error is the ingest's.
TX_ATTEMPTS = 4
# Pause before such a retry: this times the attempt number, plus up to as much jitter.
TX_RETRY_PAUSE_SECONDS = 0.05
RETRYABLE_TX_ERRORS = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)

# Error class counted in IngestReport.errors for a document id that is refused
# (absolute, '..', hidden, another source's; see Source.id_problem): nothing is read or written.
INVALID_DOCUMENT_ID = "invalid_document_id"
# Batches whose lookup (what the database knows of their documents) is queued before the batch
# is handed out: the next batch's documents are known by the time the extraction needs them.
LOOKUPS_AHEAD = 1
# How long an interrupted ingest waits for the server to cancel its running statement.
CANCEL_SECONDS = 5.0


@dataclass
class IngestReport(Counts):
    scanned: int = 0
    new: int = 0
    changed: int = 0
    unchanged: int = 0
    quarantined: int = 0
    deleted: int = 0
    chunks: int = 0
    enqueued: int = 0
    superseded: int = 0
    revived: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, other: IngestReport) -> None:
        """Count ``other`` in (one report over the pages of a run)."""
        for f in fields(self):
            if f.name == "errors":
                for key, count in other.errors.items():
                    self.errors[key] = self.errors.get(key, 0) + count
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


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


def ingest_documents(rt: Runtime, pool: ConnectionPool, source: Source | Path,
                     document_ids: Iterable[str]) -> IngestReport:
    """Some documents of a source (Dagster partitions, a rerun, vanished items); marked running
    meanwhile, as ``ingest_source``."""
    start_server_soon()
    with running_ingests.marked(lambda: db.pool_connect(pool)), pool.connection() as conn:
        enqueued = register_model(conn, rt)
        report = ingest_ids(conn, source, document_ids, rt.options)
    report.enqueued += enqueued
    return report


# -- machinery -------------------------------------------------------------------------------
def ingest_all(conn: psycopg.Connection, source: Source | Path, options: IngestOptions, *,
               whole: bool = False) -> IngestReport:
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
    _ingest_items(conn, source, source_id, _chain(first, items), options, report, record_seen=True)
    if report.scanned == 0 and not options.allow_empty:
        current = documents.current_count(conn, source_id)
        if current:
            raise SourceError(f"source {source.describe()} is empty but {current} documents from it are current; "
                              "refusing to tombstone them all (pass --allow-empty if this is intended)")

    def tombstone() -> list[int]:
        with conn.transaction():
            documents.write_lock(conn)
            pks = documents.tombstone_unseen(conn, source_id, scan_started)
            superseded = document_writes.tombstone(conn, pks)
            documents.mark_scanned(conn, source_id)
        return [len(pks), superseded]

    deleted, superseded = _retrying(tombstone)
    report.deleted += deleted
    report.superseded += superseded
    return report


def ingest_ids(conn: psycopg.Connection, source: Source | Path, document_ids: Iterable[str],
               options: IngestOptions) -> IngestReport:
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
    found = source.lookup(wanted)   # SourceError (unreachable): nothing below happens
    source_id = documents.register_source(conn, source)
    missing = [doc for doc in wanted if doc not in found]
    _ingest_items(conn, source, source_id, iter(found.values()), options, report, record_seen=False)
    if missing:
        def tombstone() -> list[int]:
            with conn.transaction():
                documents.write_lock(conn)
                pks = documents.tombstone_ids(conn, source_id, missing)
                return [len(pks), document_writes.tombstone(conn, pks)]

        deleted, superseded = _retrying(tombstone)
        report.deleted += deleted
        report.superseded += superseded
    return report


def _retrying(transaction: Callable[[], T]) -> T:
    """Run ``transaction`` (which opens and commits its own); again, after a short pause,
    when the server aborted it to break a deadlock or a serialization conflict."""
    for attempt in range(1, TX_ATTEMPTS + 1):
        try:
            return transaction()
        except RETRYABLE_TX_ERRORS:
            if attempt == TX_ATTEMPTS:
                raise
            time.sleep(TX_RETRY_PAUSE_SECONDS * attempt * (1 + random.random()))
    raise AssertionError("unreachable")


def _chain(first: Item | None, rest: Iterator[Item]) -> Iterator[Item]:
    if first is not None:
        yield first
        yield from rest


def _batches(items: Iterator[Item], size: int) -> Iterator[list[Item]]:
    batch: list[Item] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _with_known(conn: psycopg.Connection, db_thread: DatabaseThread, source_id: int, items: Iterator[Item],
                report: IngestReport, size: int) -> Iterator[tuple[list[Item], dict[str, KnownDocument]]]:
    """Batches of ``size`` items with what the database holds of them, looked up in the database
    thread (before the transactions waiting there) ``LOOKUPS_AHEAD`` batches ahead of the one
    handed out. A source without a document row yet has nothing to look up (this ingest's own
    batches hold other documents: a listing names a document once)."""
    if not db_thread.result(db_thread.lookup(documents.has_documents, conn, source_id)):
        for batch in _batches(items, size):
            report.scanned += len(batch)
            yield batch, {}
        return
    ahead: deque[tuple[list[Item], Future[dict[str, KnownDocument]]]] = deque()
    for batch in _batches(items, size):
        report.scanned += len(batch)
        ahead.append((batch, db_thread.lookup(document_writes.known_documents, conn, source_id,
                                              [i.document_id for i in batch])))
        if len(ahead) > LOOKUPS_AHEAD:
            done, known = ahead.popleft()
            yield done, db_thread.result(known)
    while ahead:
        done, known = ahead.popleft()
        yield done, db_thread.result(known)


def _ingest_items(conn: psycopg.Connection, source: Source, source_id: int, items: Iterator[Item],
                  options: IngestOptions, report: IngestReport, *, record_seen: bool) -> None:
    """Process and write ``items``: one transaction per ``batch_documents`` documents done, or
    sooner once the results hold ``batch_bytes`` of chunk text (``options.config``). Documents
    are extracted in ``extract_processes`` children and the transactions run in a thread of their
    own (``ingest_writes.DatabaseThread``, in order): reading, extracting and writing overlap.
    The chunks' text-search vectors are computed after the last transaction
    (``store.text_search``), unless ``options.text_search_later``."""
    config = options.config
    spec = ExtractSpec(chunker=options.chunker, decode_errors=config.decode_errors,
                       max_text_chars=config.max_text_chars, max_chunks=config.max_chunks)

    def count(written: dict[str, int]) -> None:
        for key in ("chunks", "enqueued", "revived", "superseded"):
            setattr(report, key, getattr(report, key) + written.get(key, 0))

    with Extractor(spec, timeout=config.stage_timeout, memory_limit=config.extract_memory,
                   processes=config.extract_processes) as extractor, \
            DatabaseThread(cancel=lambda: conn.cancel_safe(timeout=CANCEL_SECONDS)) as db_thread:
        seen: list[str] = []
        todo: list[Processed] = []
        held = 0
        known = _with_known(conn, db_thread, source_id, items, report, config.batch_documents)
        for item, old, processed in process_items(source, known, extractor=extractor, max_bytes=config.max_bytes,
                                                  extractor_version=options.extractor_version, force=options.force):
            seen.append(item.document_id)
            if processed is not None:
                if old is None or old.status == "deleted":
                    report.new += 1
                else:
                    report.changed += 1
                if processed.error_class:
                    report.quarantined += 1
                    report.errors[processed.error_class] = report.errors.get(processed.error_class, 0) + 1
                todo.append(processed)
                held += processed.text_bytes
            else:
                report.unchanged += 1
            if held >= config.batch_bytes or len(seen) >= config.batch_documents:
                db_thread.write(count, _write, conn, source_id, seen, todo, options, record_seen)
                seen, todo, held = [], [], 0
        db_thread.write(count, _write, conn, source_id, seen, todo, options, record_seen)
        db_thread.finish()
    if not options.text_search_later:
        text_search.fill(conn)


def _write(conn: psycopg.Connection, source_id: int, seen: list[str], todo: list[Processed],
           options: IngestOptions, record_seen: bool) -> dict[str, int]:
    """One ingest transaction: the ids seen, the documents processed (retried on a deadlock).
    Returns the counts written (chunks, enqueued, revived, superseded)."""
    if not todo and not (record_seen and seen):
        return {}

    def transaction() -> dict[str, int]:
        with conn.transaction():
            if record_seen:
                documents.record_seen(conn, seen)
            if not todo:
                return {}
            documents.write_lock(conn)
            return document_writes.write_documents(
                conn, source_id, todo, extractor_version=options.extractor_version,
                chunker_version=options.chunker.version, max_attempts=options.config.max_attempts,
                config_hash=options.config_hash, dagster_run_id=options.dagster_run_id)

    return _retrying(transaction)


# The names older revisions have (benchmarks that compare revisions import them).
ingest_directory = ingest_all
ingest_paths = ingest_ids
