"""How a table source finds its changes without a complete listing; the changed rows are read and
written through ingest's own path (``ingest_batches.ingest_items``).

``scan_table`` works one of three ways (docs/sources.md, a PostgreSQL table): **full** (the table's
digest, then per bucket, then the rows of differing buckets), **watermark** (``&updated=COL``: rows
at or past the stored watermark, then the full digest) or **change log** (the ids the triggers
logged, deleted only after their documents are committed; a TRUNCATE makes it a full check).

A failed listing or read raises before anything is tombstoned; a row's version is recorded in
``app.table_rows`` only after its document is committed, so a crash re-reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg

from pipeline_assets.app import document_writes, ingest_batches
from pipeline_assets.app.ingest_batches import IngestReport
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.jobqueue import crashpoints
from pipeline_assets.store import change_log, documents, table_rows
from pipeline_assets.store.table_source import READ_PAGE_ROWS, TableSourceError

if TYPE_CHECKING:
    from pipeline_assets.app.table_source import TableSource

# How a scan finds the changed rows.
FULL, WATERMARK, CHANGE_LOG = "full", "watermark", "change_log"


@dataclass
class TableScan:
    """What a scan looked at: its way, the buckets and rows listed, the rows read."""

    way: str
    buckets_listed: int = 0
    rows_listed: int = 0
    rows_read: int = 0
    log_entries: int = 0


def default_way(source: TableSource) -> str:
    """The change log when its triggers are installed, else the watermark when the source
    names an updated column, else the full check."""
    if change_log.is_installed(source.table):
        return CHANGE_LOG
    return WATERMARK if source.spec.updated else FULL


def scan_table(
    conn: psycopg.Connection, source: TableSource, options: IngestOptions, *, way: str | None = None
) -> tuple[IngestReport, TableScan]:
    """Find and ingest the changes of ``source`` (see the module docstring)."""
    way = way or default_way(source)
    report, scan = IngestReport(), TableScan(way)
    run = _Scan(conn, source, options, report, scan)
    if way == CHANGE_LOG:
        entries = change_log.read(source.table)
        scan.log_entries = len(entries.seqs)
        # A TRUNCATE, or a table never scanned (its rows from before the triggers are in no entry).
        if entries.truncated or not table_rows.stored_count(conn, source.key):
            run.full()
        else:
            run.rows(entries.row_ids)
        crashpoints.reach(crashpoints.LOG_UNCONSUMED, source.config.crashpoint)
        change_log.consumed(source.table, entries.seqs)  # after the documents of their rows are committed
    elif way == WATERMARK:
        run.watermark()
    else:
        run.full()
    return report, scan


class _Scan:
    """One scan of one table: list, compare, read, write, record."""

    def __init__(
        self,
        conn: psycopg.Connection,
        source: TableSource,
        options: IngestOptions,
        report: IngestReport,
        scan: TableScan,
    ) -> None:
        self.conn, self.source, self.options, self.report, self.scan = conn, source, options, report, scan
        self.table = source.table
        self.key = source.key
        self.source_id = documents.register_source(conn, source)

    # -- finding changes ---------------------------------------------------------------
    def _differing(self) -> list[int]:
        """The buckets whose digest differs from the stored one (none when the totals are equal).
        An empty table whose rows were ingested is refused unless ``allow_empty`` (a wrong
        database or a truncated table: tombstoning everything must be meant)."""
        theirs_total = self.table.total()
        ours_total = table_rows.stored_total(self.conn, self.key)
        if theirs_total == ours_total:
            return []
        if theirs_total[0] == 0 and not self.options.allow_empty:
            raise TableSourceError(
                f"table source {self.source.spec.name} is empty but {ours_total[0]} of its rows "
                "were ingested; refusing to tombstone them all (pass --allow-empty if this "
                "is intended)"
            )
        theirs = self.table.digest()
        ours = table_rows.stored_digest(self.conn, self.key)
        return sorted(b for b in theirs.keys() | ours.keys() if theirs.get(b) != ours.get(b))

    def _listed(self, rows: Iterable[tuple[object, ...]]) -> None:
        """Copy a streamed listing (row_id, id_hash, version, ...) into the database to compare."""
        self.scan.rows_listed += table_rows.copy_listing(self.conn, rows)

    def _read_changed(self) -> None:
        """Read and ingest the listed rows that changed, a page at a time (keyset on the id)."""
        after = ""
        while page := table_rows.listed_changed(self.conn, self.key, after=after, limit=READ_PAGE_ROWS):
            self.rows(page)
            after = page[-1]

    def _check_buckets(self, buckets: list[int]) -> None:
        """List ``buckets``, read their changed rows, tombstone their gone ones (after the
        listing completed: a failed listing raised before this)."""
        if not buckets:
            return
        self.scan.buckets_listed += len(buckets)
        self._listed(self.table.list_buckets(buckets))
        self._read_changed()
        while gone := table_rows.listed_gone(self.conn, self.key, buckets, limit=READ_PAGE_ROWS):
            self._gone(gone)  # forgets them: the next page is the next ones

    def full(self) -> None:
        newest = self.table.newest_updated() if self.source.spec.updated else None
        self._check_buckets(self._differing())
        self._mark(newest)

    def watermark(self) -> None:
        stored = table_rows.watermark(self.conn, self.key)
        newest = self.table.newest_updated()  # before the listing: a row updated meanwhile is listed next time
        self._listed(self.table.list_updated(stored))
        self._read_changed()
        self._mark(newest)
        self._check_buckets(self._differing())  # deletes, late commits, texts changed alone

    def _mark(self, newest: str | None) -> None:
        if newest is not None:
            table_rows.set_watermark(self.conn, self.key, newest)

    # -- reading and writing -----------------------------------------------------------
    def rows(self, row_ids: list[str]) -> None:
        """Read and ingest ``row_ids`` a page at a time; those that no longer exist are gone."""
        for start in range(0, len(row_ids), READ_PAGE_ROWS):
            page = row_ids[start : start + READ_PAGE_ROWS]
            items = self.source.rows(page, self.options.config.max_bytes)
            self.scan.rows_read += len(items)
            page_report = IngestReport()
            ingest_batches.ingest_items(
                self.conn, self.source, self.source_id, iter(items), self.options, page_report, record_seen=False
            )
            self.report.add(page_report)
            if items:  # the documents are committed: their versions are what was ingested
                table_rows.record_rows(
                    self.conn,
                    self.key,
                    [i.row_id for i in items],
                    [i.row.id_hash for i in items if i.row],
                    [i.row.version for i in items if i.row],
                )
            present = {i.row_id for i in items}
            self._gone([r for r in page if r not in present])

    def _gone(self, row_ids: list[str]) -> None:
        if not row_ids:
            return
        doc_ids = [self.source.spec.document_id(r) for r in row_ids]

        def tombstone() -> list[int]:
            with self.conn.transaction():
                documents.write_lock(self.conn)
                pks = documents.tombstone_ids(self.conn, self.source_id, doc_ids)
                superseded = document_writes.tombstone(self.conn, pks)
                table_rows.forget_rows(self.conn, self.key, row_ids)
                return [len(pks), superseded]

        deleted, superseded = ingest_batches.retrying(tombstone)
        self.report.deleted += deleted
        self.report.superseded += superseded
