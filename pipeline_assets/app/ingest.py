"""Ingest: scan a source, checksum, extract, chunk, enqueue. No provider calls.

Idempotent: an item whose raw bytes and extractor/chunker versions are unchanged
is skipped (a duplicate event creates no work). A changed item has its chunks
replaced and its new chunks enqueued in one transaction per batch, and the
jobs of content no longer wanted are superseded at once. Items gone from the
source are tombstoned after a complete scan.

The use cases (``ingest_source``, ``ingest_documents``) are what the command
line and the Dagster assets and sensors call; the rest is their machinery.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import documents
from pipeline_assets.app.runtime import IngestOptions, Runtime
from pipeline_assets.content.process import Processed, process_item
from pipeline_assets.content.sources import SourceError, SourceItem, scan_directory
from pipeline_assets.jobs import models, transitions
from pipeline_assets.settings import INGEST_BATCH_DOCUMENTS


@dataclass
class IngestReport:
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

    def as_dict(self) -> dict:
        return asdict(self)


# -- use cases ---------------------------------------------------------------------------
def register_model(conn: psycopg.Connection, rt: Runtime) -> int:
    """Register (or re-activate) the runtime's model; a model seen for the first
    time gets jobs for every current chunk ingested before it. Returns the jobs enqueued."""
    if models.ensure_model(conn, rt.provider.spec):
        return transitions.enqueue_missing(conn, rt.options.max_attempts)
    return 0


def ingest_source(rt: Runtime, pool: ConnectionPool, root: Path) -> IngestReport:
    """`ingest DIR`: the whole source; documents gone from it are tombstoned."""
    with pool.connection() as conn:
        enqueued = register_model(conn, rt)
        report = ingest_directory(conn, root, rt.options)
    report.enqueued += enqueued
    return report


def ingest_documents(rt: Runtime, pool: ConnectionPool, root: Path, document_ids: Iterable[str]) -> IngestReport:
    """Some documents of a source (Dagster partitions, a rerun, vanished files)."""
    with pool.connection() as conn:
        enqueued = register_model(conn, rt)
        report = ingest_paths(conn, root, document_ids, rt.options)
    report.enqueued += enqueued
    return report


# -- machinery -------------------------------------------------------------------------------
def ingest_directory(conn: psycopg.Connection, root: Path, options: IngestOptions) -> IngestReport:
    """Scan everything under ``root``; tombstone what is no longer there."""
    root = Path(root).expanduser().resolve()
    items = scan_directory(root)
    scan_started = documents.start_scan(conn)
    first = next(items, None)  # raises SourceError for a missing root, before anything is registered
    source_id = documents.register_source(conn, root)
    report = IngestReport()
    _ingest_items(conn, source_id, _chain(first, items), options, report, record_seen=True)
    if report.scanned == 0 and not options.allow_empty:
        current = documents.current_count(conn, source_id)
        if current:
            raise SourceError(f"source {root} is empty but {current} documents from it are current; "
                              "refusing to tombstone them all (pass --allow-empty if this is intended)")
    with conn.transaction():
        documents.write_lock(conn)
        _tombstone(conn, report, documents.tombstone_unseen(conn, source_id, scan_started))
        documents.mark_scanned(conn, source_id)
    return report


def ingest_paths(conn: psycopg.Connection, root: Path, document_ids: Iterable[str],
                 options: IngestOptions) -> IngestReport:
    """Ingest only some documents of a source. An id whose file is gone is tombstoned."""
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise SourceError(f"source directory not found: {root}")
    source_id = documents.register_source(conn, root)
    report = IngestReport()
    present, missing = [], []
    for doc_id in document_ids:
        path = root / doc_id
        if path.is_file():
            st = path.stat()
            present.append(SourceItem(doc_id, path, st.st_size, st.st_mtime_ns, path.as_uri()))
        else:
            missing.append(doc_id)
    _ingest_items(conn, source_id, iter(present), options, report, record_seen=False)
    if missing:
        with conn.transaction():
            documents.write_lock(conn)
            _tombstone(conn, report, documents.tombstone_ids(conn, source_id, missing))
    return report


def _tombstone(conn: psycopg.Connection, report: IngestReport, doc_pks: list[int]) -> None:
    report.deleted += len(doc_pks)
    report.superseded += documents.tombstone(conn, doc_pks)


def _chain(first: SourceItem | None, rest: Iterator[SourceItem]) -> Iterator[SourceItem]:
    if first is not None:
        yield first
        yield from rest


def _batches(items: Iterator[SourceItem], size: int) -> Iterator[list[SourceItem]]:
    batch: list[SourceItem] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _ingest_items(conn: psycopg.Connection, source_id: int, items: Iterator[SourceItem],
                  options: IngestOptions, report: IngestReport, *, record_seen: bool) -> None:
    for batch in _batches(items, INGEST_BATCH_DOCUMENTS):
        report.scanned += len(batch)
        known = documents.known_documents(conn, source_id, [i.document_id for i in batch])
        todo: list[Processed] = []
        for item in batch:
            old = known.get(item.document_id)
            processed = process_item(item, old, chunker=options.chunker, max_bytes=options.max_bytes,
                                     decode_errors=options.decode_errors, stage_timeout=options.stage_timeout,
                                     extractor_version=options.extractor_version, force=options.force)
            if processed is None:
                report.unchanged += 1
                continue
            if old is None or old.status == "deleted":
                report.new += 1
            else:
                report.changed += 1
            if processed.error_class:
                report.quarantined += 1
                report.errors[processed.error_class] = report.errors.get(processed.error_class, 0) + 1
            todo.append(processed)
        with conn.transaction():
            if record_seen:
                documents.record_seen(conn, (item.document_id for item in batch))
            if todo:
                documents.write_lock(conn)
                counts = documents.write_documents(
                    conn, source_id, todo, extractor_version=options.extractor_version,
                    chunker_version=options.chunker.version, max_attempts=options.max_attempts,
                    config_hash=options.config_hash, run_id=options.run_id)
                report.chunks += counts["chunks"]
                report.enqueued += counts["enqueued"]
                report.revived += counts["revived"]
                report.superseded += counts["superseded"]
