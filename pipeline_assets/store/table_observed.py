"""What the source sensor vouches for of a table source (SQL: the ``observed_*`` queries of
``sql/queries/table_rows.sql``): whether a complete listing of it was observed, and the table's
digest taken around that listing (app.table_observed)."""

from __future__ import annotations

import psycopg

from pipeline_assets.store import queries

ROWS = queries.load("table_rows")


def observed_any(conn: psycopg.Connection, key: str) -> bool:
    """Whether the source sensor holds observations of the source ``key``."""
    return bool(queries.scalar(conn, ROWS.observed_any, {"root": key}))


def observed_digest(conn: psycopg.Connection, key: str) -> tuple[int, int] | None:
    """(rows, digest) of the table at the last complete observation; None when none holds."""
    row = conn.execute(ROWS.observed_digest, {"source": key}).fetchone()
    return None if row is None else (row[0], row[1])


def set_observed_digest(conn: psycopg.Connection, key: str, rows: int, digest: int) -> None:
    conn.execute(ROWS.set_observed_digest, {"source": key, "rows": rows, "digest": digest})


def forget_observed_digest(conn: psycopg.Connection, key: str) -> None:
    conn.execute(ROWS.forget_observed_digest, {"source": key})
