"""What the pipeline last read of a table source (SQL: ``sql/queries/table_rows.sql``).

* app.table_rows: each ingested row's change token, recorded only after its document is
  committed; a scan's listing (a session temp table) is compared against it in the database.
* app.table_marks: how far a watermark scan has read the source's updated column.
* app.table_observed: the table's digest taken around the source sensor's last complete
  listing (a cheap no-change check).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import psycopg

from pipeline_assets.store import queries
from pipeline_assets.store.table_source import BUCKET_MASK

ROWS = queries.load("table_rows")


# -- rows read (app.table_rows) ---------------------------------------------------------------
def stored_count(conn: psycopg.Connection, key: str) -> int:
    """Rows recorded for the source ``key`` (0: never scanned)."""
    return int(queries.scalar(conn, ROWS.stored_count, {"source": key}))


def stored_total(conn: psycopg.Connection, key: str) -> tuple[int, int]:
    """(rows, digest) of the recorded rows, as the source's ``total_full`` computes it."""
    rows, digest = queries.one_row(conn, ROWS.stored_total, {"source": key})
    return rows, digest


def stored_digest(conn: psycopg.Connection, key: str) -> dict[int, tuple[int, int]]:
    """{bucket: (rows, digest)} of the recorded rows, as the source's ``digest_full`` computes it."""
    return {b: (n, x) for b, n, x in conn.execute(ROWS.stored_digest, {"source": key, "mask": BUCKET_MASK})}


def record_rows(
    conn: psycopg.Connection, key: str, ids: Sequence[str], hashes: Sequence[int], versions: Sequence[int]
) -> None:
    """The change tokens of rows whose documents were just committed."""
    params = {"source": key, "ids": list(ids), "hashes": list(hashes), "versions": list(versions)}
    conn.execute(ROWS.record_rows, params)


def forget_rows(conn: psycopg.Connection, key: str, ids: Sequence[str]) -> None:
    """Rows gone from the source (their documents tombstoned)."""
    conn.execute(ROWS.forget_rows, {"source": key, "ids": list(ids)})


# -- one scan's listing (a temp table of this session) ----------------------------------------
def copy_listing(conn: psycopg.Connection, rows: Iterable[tuple[object, ...]]) -> int:
    """Copy a streamed listing (row_id, id_hash, version, ...) into ``table_listed``, replacing
    the previous one; how many rows."""
    conn.execute(ROWS.listed_create)
    conn.execute(ROWS.listed_truncate)
    n = 0
    with conn.cursor().copy(ROWS.listed_copy) as copy:
        for row in rows:
            copy.write_row(row[:3])
            n += 1
    conn.execute(ROWS.listed_analyze)
    return n


def listed_changed(conn: psycopg.Connection, key: str, *, after: str, limit: int) -> list[str]:
    """Up to ``limit`` listed row ids past ``after`` whose version is not the recorded one."""
    return [r[0] for r in conn.execute(ROWS.listed_changed, {"source": key, "after": after, "limit": limit})]


def listed_gone(conn: psycopg.Connection, key: str, buckets: Sequence[int], *, limit: int) -> list[str]:
    """Up to ``limit`` recorded row ids of ``buckets`` that the listing did not find."""
    params = {"source": key, "mask": BUCKET_MASK, "buckets": list(buckets), "limit": limit}
    return [r[0] for r in conn.execute(ROWS.listed_gone, params)]


# -- the watermark (app.table_marks) -----------------------------------------------------------
def watermark(conn: psycopg.Connection, key: str) -> str | None:
    row = conn.execute(ROWS.watermark, {"source": key}).fetchone()
    return row[0] if row else None


def set_watermark(conn: psycopg.Connection, key: str, mark: str) -> None:
    conn.execute(ROWS.set_watermark, {"source": key, "mark": mark})


# -- what the source sensor vouches for (app.table_observed) ----------------------------------
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
