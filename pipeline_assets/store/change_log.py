"""The optional change log of a table source (SQL: ``sql/queries/change_log.sql``).

``install`` creates, in the source's database, the schema ``pipeline_changes``
(one log table, one SECURITY DEFINER trigger function) and three triggers on the
source table: inserts, deletes, updates that change the id or the text, and every
TRUNCATE become entries. The pipeline reads the oldest entries (``read``), ingests
their rows, and only then deletes exactly the entries it read (``consumed``): a
crash in between re-reads them, and ingest is idempotent. Installing needs the
TRIGGER privilege on the table (or owning it) and CREATE on the database.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from pipeline_assets.store import queries
from pipeline_assets.store.table_source import OpenTable, TableSourceError

LOG_SQL = queries.load("change_log")

# Entries one consumption reads at most (a sensor tick's share of a large backlog).
READ_ENTRIES = 10_000
TRUNCATE = "T"


@dataclass(frozen=True)
class Entries:
    """Entries read from the log: their sequence numbers, the distinct row ids they name,
    and whether one is a TRUNCATE (every row may be gone: a full check is due)."""

    seqs: list[int]
    row_ids: list[str]
    truncated: bool


def _compose(table: OpenTable, template: str) -> sql.Composed:
    spec = table.spec
    return sql.SQL(template).format(
        table=sql.Identifier(spec.schema, spec.table),
        id=sql.Identifier(spec.id),
        text=sql.Identifier(spec.text),
        id_name=sql.Literal(spec.id),
    )


def _drops() -> tuple[str, ...]:
    return (LOG_SQL.drop_row_trigger, LOG_SQL.drop_update_trigger, LOG_SQL.drop_truncate_trigger)


def _denied(table: OpenTable, exc: psycopg.Error) -> TableSourceError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return TableSourceError(
        f"table source {table.spec.name}: cannot install the change log: {first} "
        "(the role needs TRIGGER on the table and CREATE on the database)"
    )


def install(table: OpenTable) -> None:
    """Create (or re-create) the log and the triggers of ``table``: one transaction."""
    conn = table.conn
    try:
        with conn.transaction():
            for statement in (
                LOG_SQL.create_schema,
                LOG_SQL.create_log,
                LOG_SQL.create_log_index,
                LOG_SQL.create_function,
            ):
                conn.execute(statement)
            for template in (
                *_drops(),
                LOG_SQL.create_row_trigger,
                LOG_SQL.create_update_trigger,
                LOG_SQL.create_truncate_trigger,
            ):
                conn.execute(_compose(table, template))
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.WrongObjectType) as exc:
        raise _denied(table, exc) from None


def uninstall(table: OpenTable) -> None:
    """Drop the triggers of ``table`` and its pending entries (the schema stays for other tables)."""
    conn = table.conn
    try:
        with conn.transaction():
            for template in _drops():
                conn.execute(_compose(table, template))
            if installed_log(conn):
                conn.execute(LOG_SQL.forget_source, {"source": table.spec.name})
    except psycopg.errors.InsufficientPrivilege as exc:
        raise _denied(table, exc) from None


def installed_log(conn: psycopg.Connection) -> bool:
    return bool(queries.scalar(conn, LOG_SQL.log_exists))


def is_installed(table: OpenTable) -> bool:
    """Whether the table's three triggers exist (then its changes arrive through the log)."""
    return bool(queries.scalar(table.conn, LOG_SQL.installed, {"oid": table.oid})) and installed_log(table.conn)


def read(table: OpenTable, limit: int = READ_ENTRIES) -> Entries:
    """The oldest ``limit`` entries of ``table`` (nothing is deleted)."""
    try:
        rows = table.conn.execute(LOG_SQL.read_entries, {"source": table.spec.name, "limit": limit}).fetchall()
    except psycopg.Error as exc:
        raise TableSourceError(
            f"table source {table.spec.name}: cannot read the change log: "
            f"{(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"
        ) from None
    ids = list(dict.fromkeys(r[1] for r in rows if r[1] is not None))
    return Entries([r[0] for r in rows], ids, any(r[2] == TRUNCATE for r in rows))


def consumed(table: OpenTable, seqs: Sequence[int]) -> None:
    """Delete the entries read, once their rows' documents are committed."""
    if seqs:
        table.conn.execute(LOG_SQL.delete_entries, {"seqs": list(seqs)})


def pending(table: OpenTable) -> int:
    return (
        queries.scalar(table.conn, LOG_SQL.pending_count, {"source": table.spec.name})
        if installed_log(table.conn)
        else 0
    )
