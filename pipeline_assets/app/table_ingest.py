"""Ingest a table source: find the rows that changed, read only those, and write their
documents through the same path as files (extract in the child, one transaction per
batch, chunks replaced, jobs enqueued and superseded).

Changes are found three ways (``TableScan``):

* **full**: the table's per-bucket digest (computed by its database) against the
  stored one; only rows of buckets that differ are listed (id and change token,
  no text), compared set-based with ``app.table_rows``; the changed ones are read,
  those no longer listed are gone. An unchanged table reads no row.
* **watermark** (``&updated=COL``): rows whose updated value is at or past the
  stored watermark are listed and compared; deletes and rows inserted with an
  old updated value are found by the per-bucket digest of the ids alone.
* **change log** (after ``source install-triggers``): the ids the triggers logged
  are read; a TRUNCATE makes it a full check. Entries are deleted only after the
  documents of their rows are committed.

A listing or read that fails (the table locked, the role's grant revoked, the
server gone) raises ``TableSourceError`` before anything is tombstoned: a failed
listing is never an empty one. NULL or empty text is a skip (counted in
``skipped``, its document tombstoned if it had one); text over the size guard is
quarantined without the text leaving the source's server. A row's change token
is recorded only after its document is committed, so a crash re-reads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import documents
from pipeline_assets.app import ingest as ingest_mod
from pipeline_assets.app.ingest import IngestReport, register_model
from pipeline_assets.app.runtime import IngestOptions, Runtime
from pipeline_assets.content.extract import TOO_LARGE
from pipeline_assets.content.process import Extractor, ExtractSpec, KnownDocument, Processed
from pipeline_assets.content.sources import SourceItem
from pipeline_assets.settings import INGEST_BATCH_DOCUMENTS, Settings
from pipeline_assets.store import change_log, db, queries
from pipeline_assets.store.table_source import (
    BUCKET_MASK,
    READ_PAGE_ROWS,
    OpenTable,
    Row,
    TableSpec,
    open_table,
)

ROWS = queries.load("table_rows")

# How a scan finds the changed rows.
FULL, WATERMARK, CHANGE_LOG = "full", "watermark", "change_log"


@dataclass
class TableScan:
    """What a scan looked at: its way, the buckets listed, the rows listed and read."""

    way: str
    buckets_listed: int = 0
    rows_listed: int = 0
    rows_read: int = 0
    skipped: int = 0
    log_entries: int = 0


@contextmanager
def source_connection(settings: Settings, pool: ConnectionPool) -> Iterator[psycopg.Connection]:
    """A connection to the database of table sources: PIPELINE_SOURCE_DATABASE_URL, else the
    project's own. Unreachable is one line without the password (``db.DatabaseUnavailable``)."""
    conn = db.connect(settings.source_database_url or db.pool_url(pool))
    try:
        yield conn
    finally:
        conn.close()


@contextmanager
def opened(settings: Settings, pool: ConnectionPool, spec: TableSpec) -> Iterator[OpenTable]:
    with source_connection(settings, pool) as conn:
        yield open_table(conn, spec)


def ingest_table(rt: Runtime, pool: ConnectionPool, spec: TableSpec, *, way: str | None = None) -> IngestReport:
    """`ingest table:...`: the table's changes (``way``: FULL, WATERMARK, CHANGE_LOG; by
    default the change log when installed, else the watermark when the source names an
    updated column, else the full check)."""
    with opened(rt.settings, pool, spec) as table, pool.connection() as conn:
        enqueued = register_model(conn, rt)
        report, _ = scan_table(conn, table, rt.options, way=way)
    report.enqueued += enqueued
    return report


def ingest_table_rows(rt: Runtime, pool: ConnectionPool, spec: TableSpec, document_ids: Iterable[str]) -> IngestReport:
    """Some documents of a table source (Dagster partitions, a refresh): read; gone ones tombstoned."""
    with opened(rt.settings, pool, spec) as table, pool.connection() as conn:
        enqueued = register_model(conn, rt)
        report = IngestReport()
        row_ids = [r for d in document_ids if (r := spec.row_id(d)) is not None]
        _Ingest(conn, table, rt.options, report, TableScan(FULL)).rows(row_ids)
    report.enqueued += enqueued
    return report


def default_way(conn: psycopg.Connection, table: OpenTable) -> str:
    if change_log.is_installed(table):
        return CHANGE_LOG
    return WATERMARK if table.spec.updated else FULL


def scan_table(conn: psycopg.Connection, table: OpenTable, options: IngestOptions, *,
               way: str | None = None) -> tuple[IngestReport, TableScan]:
    """Find and ingest the changes of ``table``; see the module docstring."""
    way = way or default_way(conn, table)
    report, scan = IngestReport(), TableScan(way)
    run = _Ingest(conn, table, options, report, scan)
    if way == CHANGE_LOG:
        entries = change_log.read(table)
        scan.log_entries = len(entries.seqs)
        if entries.truncated:
            run.full()
        else:
            run.rows(entries.row_ids)
        change_log.consumed(table, entries.seqs)  # after the documents of their rows are committed
    elif way == WATERMARK:
        run.watermark()
    else:
        run.full()
    return report, scan


class _Ingest:
    """One scan's work on one table: list, compare, read, write, record."""

    def __init__(self, conn: psycopg.Connection, table: OpenTable, options: IngestOptions,
                 report: IngestReport, scan: TableScan) -> None:
        self.conn, self.table, self.options, self.report, self.scan = conn, table, options, report, scan
        self.source = table.spec.uri
        self.source_id = documents.register_source(conn, Path(self.source))

    # -- finding changes ---------------------------------------------------------------
    def _differing(self, *, ids_only: bool) -> list[int]:
        """The buckets whose digest differs from the stored one (none: the totals are equal)."""
        total = ROWS.stored_id_total if ids_only else ROWS.stored_total
        if self.table.total(ids_only=ids_only) == tuple(queries.one_row(self.conn, total, {"source": self.source})):
            return []
        theirs = self.table.digest(ids_only=ids_only)
        query = ROWS.stored_id_digest if ids_only else ROWS.stored_digest
        ours = {b: (n, x) for b, n, x in self.conn.execute(query, {"source": self.source, "mask": BUCKET_MASK})}
        return sorted(b for b in theirs.keys() | ours.keys() if theirs.get(b) != ours.get(b))

    def _listed(self, rows: Iterable[tuple]) -> None:
        """Copy a streamed listing (row_id, id_hash, version, ...) into ``table_listed``."""
        self.conn.execute(ROWS.listed_create)
        self.conn.execute(ROWS.listed_truncate)
        with self.conn.cursor().copy(ROWS.listed_copy) as copy:
            for row in rows:
                copy.write_row(row[:3])
                self.scan.rows_listed += 1
        self.conn.execute(ROWS.listed_analyze)

    def _check_buckets(self, buckets: list[int]) -> None:
        """List ``buckets``, read their changed rows, tombstone their gone ones."""
        if not buckets:
            return
        self.scan.buckets_listed += len(buckets)
        self._listed(self.table.list_buckets(buckets))
        changed = [r[0] for r in self.conn.execute(ROWS.listed_changed, {"source": self.source})]
        gone = [r[0] for r in self.conn.execute(ROWS.listed_gone, {"source": self.source, "mask": BUCKET_MASK,
                                                                   "buckets": buckets})]
        self.rows(changed)
        self._gone(gone)

    def full(self) -> None:
        newest = self.table.newest_updated() if self.table.spec.updated else None
        self._check_buckets(self._differing(ids_only=False))
        self._mark(newest)

    def _mark(self, newest: str | None) -> None:
        if newest is not None:
            self.conn.execute(ROWS.set_watermark, {"source": self.source, "mark": newest})

    def watermark(self) -> None:
        stored = self.conn.execute(ROWS.watermark, {"source": self.source}).fetchone()
        mark = stored[0] if stored else None
        newest = self.table.newest_updated()
        self._listed(self.table.list_updated(mark))
        self.rows([r[0] for r in self.conn.execute(ROWS.listed_changed, {"source": self.source})])
        self._mark(newest)
        self._check_buckets(self._differing(ids_only=True))

    # -- reading and writing -----------------------------------------------------------
    def rows(self, row_ids: list[str]) -> None:
        """Read and ingest ``row_ids`` a page at a time; those that no longer exist are gone."""
        for start in range(0, len(row_ids), READ_PAGE_ROWS):
            page = row_ids[start:start + READ_PAGE_ROWS]
            found = self.table.read(page, self.options.max_bytes)
            self.scan.rows_read += len(found)
            self._ingest(found)
            present = {r.row_id for r in found}
            self._gone([r for r in page if r not in present])

    def _gone(self, row_ids: list[str]) -> None:
        if not row_ids:
            return
        doc_ids = [self.table.spec.document_id(r) for r in row_ids]

        def tombstone() -> list[int]:
            with self.conn.transaction():
                documents.write_lock(self.conn)
                pks = documents.tombstone_ids(self.conn, self.source_id, doc_ids)
                superseded = documents.tombstone(self.conn, pks)
                self.conn.execute(ROWS.forget_rows, {"source": self.source, "ids": row_ids})
                return [len(pks), superseded]

        deleted, superseded = ingest_mod._retrying(tombstone)
        self.report.deleted += deleted
        self.report.superseded += superseded

    def _ingest(self, rows: list[Row]) -> None:
        texts = [r for r in rows if r.size]
        empty = [r for r in rows if not r.size]
        self.report.scanned += len(rows)
        self.scan.skipped += len(empty)
        self.report.skipped += len(empty)
        if texts:
            self._process(texts)
        if empty:
            self._skip(empty)
        if rows:
            self.conn.execute(ROWS.record_rows, {"source": self.source, "ids": [r.row_id for r in rows],
                                                 "hashes": [r.id_hash for r in rows],
                                                 "versions": [r.version for r in rows]})

    def _skip(self, empty: list[Row]) -> None:
        """NULL or empty text: not a document (one it was is tombstoned); counted, never an error."""
        self._gone_documents([self.table.spec.document_id(r.row_id) for r in empty])

    def _gone_documents(self, doc_ids: list[str]) -> None:
        def tombstone() -> list[int]:
            with self.conn.transaction():
                documents.write_lock(self.conn)
                pks = documents.tombstone_ids(self.conn, self.source_id, doc_ids)
                return [len(pks), documents.tombstone(self.conn, pks)]

        deleted, superseded = ingest_mod._retrying(tombstone)
        self.report.deleted += deleted
        self.report.superseded += superseded

    def _process(self, rows: list[Row]) -> None:
        options = self.options
        spec = ExtractSpec(chunker=options.chunker, decode_errors=options.decode_errors,
                           max_text_chars=options.max_text_chars, max_chunks=options.max_chunks)
        with Extractor(spec, timeout=options.stage_timeout, memory_limit=options.extract_memory) as extractor:
            for start in range(0, len(rows), INGEST_BATCH_DOCUMENTS):
                batch = rows[start:start + INGEST_BATCH_DOCUMENTS]
                items = [self._item(r) for r in batch]
                known = documents.known_documents(self.conn, self.source_id, [i.document_id for i in items])
                todo: list[Processed] = []
                held = 0
                for item, processed in _process_rows(items, batch, known, extractor, options):
                    old = known.get(item.document_id)
                    if processed is None:
                        self.report.unchanged += 1
                        continue
                    if old is None or old.status == "deleted":
                        self.report.new += 1
                    else:
                        self.report.changed += 1
                    if processed.error_class:
                        self.report.quarantined += 1
                        self.report.errors[processed.error_class] = \
                            self.report.errors.get(processed.error_class, 0) + 1
                    todo.append(processed)
                    held += processed.text_bytes
                    if held >= options.batch_bytes:
                        ingest_mod._write(self.conn, self.source_id, [], todo, options, self.report,
                                          record_seen=False)
                        todo, held = [], 0
                ingest_mod._write(self.conn, self.source_id, [], todo, options, self.report, record_seen=False)

    def _item(self, row: Row) -> SourceItem:
        doc_id = self.table.spec.document_id(row.row_id)
        return SourceItem(document_id=doc_id, path=Path(doc_id), size=row.size or 0, mtime_ns=0,
                          source_uri=doc_id, root=self.source)


def _process_rows(items: list[SourceItem], rows: list[Row], known: dict[str, KnownDocument],
                  extractor: Extractor, options: IngestOptions) -> Iterator[tuple[SourceItem, Processed | None]]:
    """Each row's result (None: unchanged), as ``content.process.process_items`` does for files:
    a row over the size guard is quarantined from its size alone (its text was never sent)."""
    chunker_version = extractor.spec.chunker.version
    for item, row in zip(items, rows):
        old = known.get(item.document_id)
        if row.text is None:
            if (not options.force and old is not None and old.status == "quarantined"
                    and old.error_class == TOO_LARGE and old.size_bytes == item.size):
                yield item, None
                continue
            yield item, Processed(item, None, None, [], TOO_LARGE,
                                  f"{item.document_id}: text of {item.size} bytes exceeds limit {options.max_bytes}")
            continue
        raw = row.text.encode("utf-8")
        checksum = hashlib.sha256(raw).digest()
        if (not options.force and old is not None
                and old.extractor_version == options.extractor_version.of(item.document_id)
                and old.chunker_version == chunker_version and old.source_checksum == checksum
                and old.status != "deleted"):
            yield item, None
            continue
        while not extractor.submit(item, checksum, raw):
            done = extractor.take()
            yield done.item, done
    while extractor.pending:
        done = extractor.take()
        yield done.item, done
