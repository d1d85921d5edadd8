"""A PostgreSQL table as a ``content.source.Source``: one row, one document.

``table:SCHEMA.TABLE?id=ID&text=TEXT[&updated=COL]`` (parsed by ``store.table_source``), in the
project's database or ``PIPELINE_SOURCE_DATABASE_URL``'s. Ids are ``table:SCHEMA.TABLE/<id>``; the
token is the row's version computed by the source database (``content_tokens``: an equal one is
never read). NULL or empty text is quarantined as ``empty_text``, oversized text as ``too_large``
from its size alone; a failure of the source as a whole is a ``SourceError`` (nothing tombstoned).
``ingest_changes`` finds what changed (``app/table_ingest.py``) instead of a complete listing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import psycopg

from pipeline_assets.app import observations
from pipeline_assets.app.ingest_batches import IngestReport
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.app.source_config import SourceConfig
from pipeline_assets.content.extract import TOO_LARGE, ExtractError
from pipeline_assets.content.source import Item, Observed, ReadOutcome, SourceError, token_checksum
from pipeline_assets.settings import redact_text
from pipeline_assets.store import change_log, db, table_rows
from pipeline_assets.store.table_source import (
    LOCK_TIMEOUT,
    READ_PAGE_ROWS,
    OpenTable,
    Row,
    TableSourceError,
    open_table,
    parse_table_source,
)

# Error class of a row whose text is NULL or empty: not a document; quarantined, never embedded.
EMPTY_TEXT = "empty_text"


@dataclass(frozen=True)
class TableItem:
    """One row as an ``Item``; ``row``: its text, when the lookup read it already."""

    document_id: str
    size: int
    token: str
    source_uri: str
    row_id: str
    mtime_ns: int = 0
    problem: str | None = None
    row: Row | None = field(default=None, compare=False, repr=False)


class TableSource:
    """The rows of one table (or view)."""

    kind = "table"
    content_tokens = True

    def __init__(self, spec: str, config: SourceConfig) -> None:
        try:
            self.spec = parse_table_source(spec)
        except TableSourceError as exc:
            raise SourceError(str(exc)) from None
        self.key = self.spec.uri
        self.config = config
        self._table: OpenTable | None = None
        self.lock_timeout = LOCK_TIMEOUT  # a locked table fails the scan after this

    def __repr__(self) -> str:
        return f"TableSource({self.key!r})"

    def describe(self) -> str:
        where = (
            redact_text(self.config.table_database_url) if self.config.table_database_url else "the project's database"
        )
        return f"table {self.spec.name} (id={self.spec.id}, text={self.spec.text}) in {where}"

    # -- the connection ---------------------------------------------------------------------
    @property
    def table(self) -> OpenTable:
        """The checked table on an open connection (opened on first use, again after a failure)."""
        if self._table is None or self._table.conn.closed:
            url = self.config.table_database_url or db.database_url(self.config.database)
            try:
                conn = db.connect(url)
            except db.DatabaseUnavailable as exc:
                raise SourceError(f"table source {self.spec.name}: {exc}") from None
            try:
                self._table = open_table(conn, self.spec, lock_timeout=self.lock_timeout)
            except TableSourceError as exc:
                conn.close()
                raise SourceError(str(exc)) from None
        return self._table

    def close(self) -> None:
        if self._table is not None:
            self._table.conn.close()
            self._table = None

    def _failed(self, exc: Exception) -> SourceError:
        """The source as a whole failed: its connection is dropped (the next use reconnects)."""
        self.close()
        return SourceError(str(exc))

    # -- the interface ----------------------------------------------------------------------
    def check(self) -> None:
        """Connect again and check the relation, its columns and the grant (SourceError)."""
        self.close()
        self.open()

    def open(self) -> OpenTable:
        return self.table

    def _item(self, row_id: str, version: int, size: int | None, row: Row | None = None) -> TableItem:
        doc = self.spec.document_id(row_id)
        return TableItem(doc, size or 0, str(version), doc, row_id, row=row)

    def items(self) -> Iterator[Item]:
        try:
            for row_id, _, version, size in self.table.list_all():
                yield self._item(row_id, version, size)
        except (TableSourceError, psycopg.Error) as exc:
            raise self._failed(exc) from None

    def observe(self, keep: Callable[[str], bool] | None = None) -> Iterator[Observed]:
        for item in self.items():
            yield Observed(item.document_id, item.size, 0, None, token_checksum(item.token))

    def fingerprint(self, observed: Observed, max_bytes: int) -> str | None:
        return observed.checksum

    def id_problem(self, document_id: str) -> str | None:
        if self.spec.row_id(document_id) is None:
            return f"not a row of {self.spec.prefix}<id>"
        return None

    def rows(self, row_ids: Sequence[str], max_bytes: int | None = None) -> list[TableItem]:
        """The rows of ``row_ids`` that exist now, read (text over ``max_bytes`` left on the server)."""
        found: list[TableItem] = []
        limit = self.config.max_bytes if max_bytes is None else max_bytes
        try:
            for start in range(0, len(row_ids), READ_PAGE_ROWS):
                for row in self.table.read(row_ids[start : start + READ_PAGE_ROWS], limit):
                    found.append(self._item(row.row_id, row.version, row.size, row))
        except TableSourceError as exc:
            raise self._failed(exc) from None
        return found

    def lookup(self, document_ids: Sequence[str]) -> dict[str, Item]:
        wanted = [r for d in document_ids if (r := self.spec.row_id(d)) is not None]
        return {item.document_id: item for item in self.rows(wanted)}

    def read(self, item: Item, max_bytes: int) -> bytes:
        ((_, outcome),) = list(self.read_all([item], max_bytes))
        if isinstance(outcome, (ExtractError, OSError)):
            raise outcome
        return outcome

    def read_all(self, items: Iterable[Item], max_bytes: int) -> Iterator[tuple[Item, ReadOutcome]]:
        """Each row's text as UTF-8, a page of rows per statement; the size guard from the
        listed size first (no text fetched); a row gone since its listing is unreadable now."""
        listed = list(items)
        for start in range(0, len(listed), READ_PAGE_ROWS):
            page = listed[start : start + READ_PAGE_ROWS]
            missing = [i.row_id for i in page if isinstance(i, TableItem) and i.row is None and i.size <= max_bytes]
            fetched = {r.row_id: r.row for r in self.rows(missing, max_bytes)} if missing else {}
            for item in page:
                assert isinstance(item, TableItem), item
                yield item, self._outcome(item, item.row or fetched.get(item.row_id), max_bytes)

    def _outcome(self, item: TableItem, row: Row | None, max_bytes: int) -> ReadOutcome:
        size = row.size if row is not None else item.size
        if size is not None and size > max_bytes:
            return ExtractError(TOO_LARGE, f"{item.document_id}: text of {size} bytes exceeds limit {max_bytes}")
        if row is None:
            return FileNotFoundError(f"{item.document_id}: the row is gone")
        if not row.text:
            return ExtractError(EMPTY_TEXT, f"{item.document_id}: text is NULL or empty; not a document")
        return row.text.encode("utf-8")

    def follow_changes(
        self, conn: psycopg.Connection, complete: Callable[[], observations.Scan], keep: Callable[[str], bool] | None
    ) -> observations.Scan:
        """The source sensor's observation (``observations.scan``) without a complete listing
        when the table can vouch for it; ``complete()`` lists everything otherwise.

        With the change log installed and a complete listing observed before: the logged
        rows' tokens (no text) are recorded as observations, then exactly those entries are
        deleted (their rows are pending observations, committed, until a bucket run ingests
        them); a TRUNCATE lists everything. Without it: while the table's digest is the one
        taken around the last complete listing, nothing changed and nothing is listed. A
        bucket run (``keep``) lists nothing more while the ticks vouch: it syncs what they observed."""
        try:
            table = self.table
            installed = change_log.is_installed(table)
            observed = table_rows.observed_any(conn, self.key)
            if not installed:
                return self._observe_by_digest(conn, table, complete, observed, keep)
            if keep is not None:
                return observations.Scan() if observed else complete()
            entries = change_log.read(table)
        except TableSourceError as exc:
            raise self._failed(exc) from None
        if entries.truncated or not observed:
            result = complete()
        else:
            present = self.rows(entries.row_ids, max_bytes=-1)  # tokens and sizes; no text sent
            found = {i.row_id for i in present}
            result = observations.record_observed(
                conn,
                self.key,
                [Observed(i.document_id, i.size, 0, None, token_checksum(i.token)) for i in present],
                [self.spec.document_id(r) for r in entries.row_ids if r not in found],
            )
        change_log.consumed(table, entries.seqs)
        return result

    def _observe_by_digest(
        self,
        conn: psycopg.Connection,
        table: OpenTable,
        complete: Callable[[], observations.Scan],
        observed: bool,
        keep: Callable[[str], bool] | None,
    ) -> observations.Scan:
        before = table.total()
        stored = table_rows.observed_digest(conn, self.key)
        if observed and stored is not None and stored == before:
            return observations.Scan(present=before[0])
        if keep is not None:
            return complete()  # some buckets only: the digest of the whole is not vouched for
        table_rows.forget_observed_digest(conn, self.key)
        result = complete()
        if table.total() == before:  # the table held still while it was listed
            table_rows.set_observed_digest(conn, self.key, before[0], before[1])
        return result

    def ingest_changes(self, conn: psycopg.Connection, options: IngestOptions, *, whole: bool = False) -> IngestReport:
        """Find and ingest the table's changes (``app/table_ingest.py``): by its change log, its
        watermark or its checksums; ``whole`` (a reconciliation): by the checksums, the change
        log left to whoever follows it."""
        from pipeline_assets.app.table_ingest import FULL, scan_table

        try:
            report, _ = scan_table(conn, self, options, way=FULL if whole else None)
        except TableSourceError as exc:
            raise self._failed(exc) from None
        return report
