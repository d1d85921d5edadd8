"""An ingest's batches: items looked up, extracted in child processes and written one transaction
per batch by a thread of its own (``app.ingest_writes``), retried when the server aborts a
transaction to break a deadlock; what was done counted in an ``IngestReport``.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import TypeVar

import psycopg

from pipeline_assets.app import document_writes
from pipeline_assets.app.ingest_writes import DatabaseThread
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.content.process import Extractor, ExtractSpec, KnownDocument, Processed, process_items
from pipeline_assets.content.source import Item, Source
from pipeline_assets.counts import Counts
from pipeline_assets.store import documents, text_search

T = TypeVar("T")

# Attempts of one ingest transaction that the server aborted to break a deadlock
# or a serialization conflict (with another ingest, a reconcile, a person's
# statement), before the error is the ingest's.
TX_ATTEMPTS = 4
# Pause before such a retry: this times the attempt number, plus up to as much jitter.
TX_RETRY_PAUSE_SECONDS = 0.05
RETRYABLE_TX_ERRORS = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)

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


def retrying(transaction: Callable[[], T]) -> T:
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


def batches(items: Iterator[Item], size: int) -> Iterator[list[Item]]:
    batch: list[Item] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def with_known(
    conn: psycopg.Connection,
    db_thread: DatabaseThread,
    source_id: int,
    items: Iterator[Item],
    report: IngestReport,
    size: int,
) -> Iterator[tuple[list[Item], dict[str, KnownDocument]]]:
    """Batches of ``size`` items with what the database holds of them, looked up in the database
    thread (before the transactions waiting there) ``LOOKUPS_AHEAD`` batches ahead of the one
    handed out. A source without a document row yet has nothing to look up (this ingest's own
    batches hold other documents: a listing names a document once)."""
    if not db_thread.result(db_thread.lookup(documents.has_documents, conn, source_id)):
        for batch in batches(items, size):
            report.scanned += len(batch)
            yield batch, {}
        return
    ahead: deque[tuple[list[Item], Future[dict[str, KnownDocument]]]] = deque()
    for batch in batches(items, size):
        report.scanned += len(batch)
        ahead.append(
            (batch, db_thread.lookup(document_writes.known_documents, conn, source_id, [i.document_id for i in batch]))
        )
        if len(ahead) > LOOKUPS_AHEAD:
            done, known = ahead.popleft()
            yield done, db_thread.result(known)
    while ahead:
        done, known = ahead.popleft()
        yield done, db_thread.result(known)


def ingest_items(
    conn: psycopg.Connection,
    source: Source,
    source_id: int,
    items: Iterator[Item],
    options: IngestOptions,
    report: IngestReport,
    *,
    record_seen: bool,
) -> None:
    """Process and write ``items``: one transaction per ``batch_documents`` documents done, or
    sooner once the results hold ``batch_bytes`` of chunk text (``options.config``). Documents
    are extracted in ``extract_processes`` children and the transactions run in a thread of their
    own (``ingest_writes.DatabaseThread``, in order): reading, extracting and writing overlap.
    The chunks' text-search vectors are computed after the last transaction
    (``store.text_search``), unless ``options.text_search_later``."""
    config = options.config
    spec = ExtractSpec(
        chunker=options.chunker,
        decode_errors=config.decode_errors,
        max_text_chars=config.max_text_chars,
        max_chunks=config.max_chunks,
    )

    def count(written: dict[str, int]) -> None:
        for key in ("chunks", "enqueued", "revived", "superseded"):
            setattr(report, key, getattr(report, key) + written.get(key, 0))

    with (
        Extractor(
            spec, timeout=config.stage_timeout, memory_limit=config.extract_memory, processes=config.extract_processes
        ) as extractor,
        DatabaseThread(cancel=lambda: conn.cancel_safe(timeout=CANCEL_SECONDS)) as db_thread,
    ):
        seen: list[str] = []
        todo: list[Processed] = []
        held = 0
        known = with_known(conn, db_thread, source_id, items, report, config.batch_documents)
        for item, old, processed in process_items(
            source,
            known,
            extractor=extractor,
            max_bytes=config.max_bytes,
            extractor_version=options.extractor_version,
            force=options.force,
        ):
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
                db_thread.write(count, write, conn, source_id, seen, todo, options, record_seen)
                seen, todo, held = [], [], 0
        db_thread.write(count, write, conn, source_id, seen, todo, options, record_seen)
        db_thread.finish()
    if not options.text_search_later:
        text_search.fill(conn)


def write(
    conn: psycopg.Connection,
    source_id: int,
    seen: list[str],
    todo: list[Processed],
    options: IngestOptions,
    record_seen: bool,
) -> dict[str, int]:
    """One ingest transaction: the ids seen, the documents processed (retried on a deadlock).
    Returns the counts written (chunks, enqueued, revived, superseded)."""
    if not todo and not (record_seen and seen):
        return {}

    def transaction() -> dict[str, int]:
        with conn.transaction():
            if not todo:
                documents.record_seen(conn, seen)
                return {}
            return document_writes.write_documents(
                conn,
                source_id,
                todo,
                extractor_version=options.extractor_version,
                chunker_version=options.chunker.version,
                max_attempts=options.config.max_attempts,
                config_hash=options.config_hash,
                dagster_run_id=options.dagster_run_id,
                seen=seen if record_seen else None,
            )

    return retrying(transaction)
