"""A PostgreSQL table (or view) as a source of documents: ``table:SCHEMA.TABLE?id=ID&text=TEXT[&updated=COL]``.

The source string names identifiers only; every statement is a template of
``sql/queries/table_source.sql`` composed with ``psycopg.sql.Identifier``. ``open_table`` checks once
that the relation and columns exist and are readable (else one line, ``TableSourceError``) and sets
a lock and statement timeout: a locked table is an error, never a hang or an empty listing.
Tokens are computed by the source database (``id_hash``, its bucket ``id_hash & BUCKET_MASK``, and
``version``); a bucket's digest (row count, bit_xor of versions) checks an unchanged table without a
row leaving the server; listings stream through a server-side cursor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import parse_qsl

import psycopg
from psycopg import sql

from pipeline_assets.store import queries

TABLE_SQL = queries.load("table_source")

SCHEME = "table:"
DEFAULT_SCHEMA = "public"
# Buckets of the unchanged check: a changed row makes its bucket's rows listed
# (their tokens only), so 4096 keeps 1,000 scattered changes to a fraction of a table.
TABLE_BUCKETS = 4096
BUCKET_MASK = TABLE_BUCKETS - 1
# Rows fetched per round trip from a server-side cursor, and ids read per statement.
STREAM_ROWS = 10_000
READ_PAGE_ROWS = 500
# A table locked by another session (or a statement stuck) fails the scan after this.
LOCK_TIMEOUT = "10s"
STATEMENT_TIMEOUT = "10min"

NEEDS_SELECT = "(the role needs SELECT on it)"
# An identifier as the catalog spells it (not folded, not quoted): letters, digits, _ and $.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")
_KEYS = {"id", "text", "updated"}


class TableSourceError(Exception):
    """The table source cannot be used or listed; the message is one line, with no password."""


@dataclass(frozen=True)
class TableSpec:
    """A parsed ``table:`` source string; identifiers only."""

    schema: str
    table: str
    id: str
    text: str
    updated: str | None = None

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def uri(self) -> str:
        """The canonical source string (what app.sources.root holds)."""
        tail = f"&updated={self.updated}" if self.updated else ""
        return f"{SCHEME}{self.name}?id={self.id}&text={self.text}{tail}"

    @property
    def prefix(self) -> str:
        """What every document id of this source starts with."""
        return f"{SCHEME}{self.name}/"

    def document_id(self, row_id: str) -> str:
        return self.prefix + row_id

    def row_id(self, document_id: str) -> str | None:
        """The row id a document id of this source names, None for another source's id."""
        if not document_id.startswith(self.prefix) or len(document_id) == len(self.prefix):
            return None
        return document_id[len(self.prefix) :]


def is_table_source(source: str) -> bool:
    return source.startswith(SCHEME)


def parse_table_source(source: str) -> TableSpec:
    """``table:[SCHEMA.]TABLE?id=COL&text=COL[&updated=COL]``: identifiers only, each at most once."""
    if not is_table_source(source):
        raise TableSourceError(f"not a table source: {source!r} (expected table:SCHEMA.TABLE?id=COL&text=COL)")
    body = source[len(SCHEME) :]
    relation, _, query = body.partition("?")
    parts = relation.split(".")
    if len(parts) == 1:
        parts = [DEFAULT_SCHEMA, *parts]
    if len(parts) != 2 or not all(_IDENTIFIER.fullmatch(p) for p in parts):
        raise TableSourceError(
            f"table source {source!r}: the relation must be SCHEMA.TABLE, identifiers only "
            "(letters, digits, _ and $; a filter is a view you create)"
        )
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False) if query else []
    options: dict[str, str] = {}
    for key, value in pairs:
        if key not in _KEYS:
            raise TableSourceError(f"table source {source!r}: unknown option {key!r} (id, text, updated)")
        if key in options:
            raise TableSourceError(f"table source {source!r}: option {key!r} given twice")
        if not _IDENTIFIER.fullmatch(value):
            raise TableSourceError(f"table source {source!r}: {key}={value!r} is not a column name (identifiers only)")
        options[key] = value
    for key in ("id", "text"):
        if key not in options:
            raise TableSourceError(f"table source {source!r}: missing {key}=COLUMN")
    return TableSpec(parts[0], parts[1], options["id"], options["text"], options.get("updated"))


@dataclass(frozen=True)
class Row:
    """One row read: its change token, its text size in bytes (None: NULL text) and its
    text (None: NULL, or over the size guard and never sent)."""

    row_id: str
    id_hash: int
    version: int
    size: int | None
    text: str | None


class OpenTable:
    """A checked table source on a connection to its database."""

    def __init__(
        self, conn: psycopg.Connection, spec: TableSpec, oid: int, id_type: str, updated_type: str | None
    ) -> None:
        self.conn = conn
        self.spec = spec
        self.oid = oid
        self._names = {
            "table": sql.Identifier(spec.schema, spec.table),
            "id": sql.Identifier(spec.id),
            "text": sql.Identifier(spec.text),
            "updated": sql.Identifier(spec.updated or spec.id),
            # types as the catalog prints them (regtype output), never from the source string
            "id_type": sql.SQL(id_type),
            "updated_type": sql.SQL(updated_type or id_type),
        }

    def statement(self, template: str) -> sql.Composed:
        """A template of sql/queries/table_source.sql with this source's identifiers."""
        return sql.SQL(template).format(**self._names)

    def _stream(self, template: str, params: dict) -> Iterator[tuple]:
        with _errors(self.spec), self.conn.transaction(), self.conn.cursor(name="table_listing") as cur:
            cur.itersize = STREAM_ROWS
            cur.execute(self.statement(template), params)
            yield from cur

    def total(self) -> tuple[int, int]:
        """``(rows, bit_xor of versions)`` of the whole table."""
        with _errors(self.spec):
            row = self.conn.execute(self.statement(TABLE_SQL.total_full)).fetchone()
        assert row is not None
        return row[0], row[1]

    def digest(self) -> dict[int, tuple[int, int]]:
        """``{bucket: (rows, bit_xor of versions)}`` of the table."""
        with _errors(self.spec):
            rows = self.conn.execute(self.statement(TABLE_SQL.digest_full), {"mask": BUCKET_MASK}).fetchall()
        return {b: (n, x) for b, n, x in rows}

    def list_buckets(self, buckets: Sequence[int]) -> Iterator[tuple[str, int, int]]:
        """``(row_id, id_hash, version)`` of every row of ``buckets``, streamed."""
        yield from self._stream(TABLE_SQL.list_buckets, {"mask": BUCKET_MASK, "buckets": list(buckets)})

    def list_all(self) -> Iterator[tuple[str, int, int, int | None]]:
        """``(row_id, id_hash, version, text bytes or None)`` of every row, streamed."""
        yield from self._stream(TABLE_SQL.list_all, {})

    def list_updated(self, mark: str | None) -> Iterator[tuple[str, int, int, str | None]]:
        """``(row_id, id_hash, version, updated)`` of the rows updated at or after ``mark``, streamed."""
        yield from self._stream(TABLE_SQL.list_updated, {"mark": mark})

    def newest_updated(self) -> str | None:
        """The greatest value of the updated column now (as text), None for an empty table."""
        with _errors(self.spec):
            row = self.conn.execute(self.statement(TABLE_SQL.newest_updated)).fetchone()
        return row[0] if row else None

    def read(self, row_ids: Sequence[str], max_bytes: int) -> list[Row]:
        """The rows of ``row_ids`` that exist now (a page; ids absent from the answer are gone)."""
        with _errors(self.spec):
            rows = self.conn.execute(
                self.statement(TABLE_SQL.read_rows), {"ids": list(row_ids), "max_bytes": max_bytes}
            ).fetchall()
        return [Row(*r) for r in rows]


def open_table(conn: psycopg.Connection, spec: TableSpec, *, lock_timeout: str = LOCK_TIMEOUT) -> OpenTable:
    """Check ``spec`` against the catalog of ``conn``'s database; one line for what is missing."""
    with _errors(spec):
        conn.execute(TABLE_SQL.set_timeouts, {"lock": lock_timeout, "statement": STATEMENT_TIMEOUT})
        rel = conn.execute(TABLE_SQL.relation, {"schema": spec.schema, "table": spec.table}).fetchone()
        if rel is None:
            raise TableSourceError(f"table source {spec.name}: no such table or view")
        oid, readable = rel
        if not readable:
            raise TableSourceError(f"table source {spec.name}: permission denied " + NEEDS_SELECT)
        wanted = [c for c in (spec.id, spec.text, spec.updated) if c]
        types: dict[str, str] = dict(conn.execute(TABLE_SQL.columns, {"oid": oid, "names": wanted}).fetchall())
    missing = [c for c in wanted if c not in types]
    if missing:
        raise TableSourceError(f"table source {spec.name}: no column {', '.join(missing)}")
    return OpenTable(conn, spec, oid, types[spec.id], types.get(spec.updated) if spec.updated else None)


class _errors:
    """Database errors of a table source as one-line ``TableSourceError``s (a failed listing is
    never an empty one: the caller stops before tombstoning anything)."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None or not isinstance(exc, psycopg.Error):
            return
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            why = "the table is locked by another session (lock timeout)"
        elif isinstance(exc, psycopg.errors.QueryCanceled):
            why = "the statement timed out"
        elif isinstance(exc, psycopg.errors.InsufficientPrivilege):
            why = "permission denied " + NEEDS_SELECT
        else:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            why = f"{type(exc).__name__}: {first}"
        raise TableSourceError(f"table source {self.spec.name}: {why}") from None
