"""What the source sensor observed, app.source_observations (SQL: ``sql/queries/observations.sql``).

A scan's walk is copied into a temporary table and compared with the observations in one join
(``walk``, ``diff``); ``stage_listed``, ``stage_unread``, ``walked_to_read`` and ``walked_missing``
read only what differs. What changed is staged and upserted in one statement (``stage``,
``commit_staged``). The rest reads and marks requests per bucket, and gives the files a request
left unsynced their backoff (``schedule_retries``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from pipeline_assets.store import queries

OBS = queries.load("observations")

# A file whose requested run ended without syncing it is requested again after the
# caller's ``retry_base`` seconds, then twice as long after each further failed request
# of the same bytes, at most RETRY_CAP_SECONDS: a persistently failing run is retried
# about once an hour, not at every tick.
RETRY_CAP_SECONDS = 3600.0

# The name of the server-side cursor over the walked files a scan has to read.
TO_READ_CURSOR = "observations_to_read"

# A walked item: (document id, size, mtime_ns, kept by the scan, the listing's checksum or None).
WalkedRow = tuple[str, int, int, bool, str | None]
# A staged observation: (document id, checksum, size, mtime_ns).
StagedRow = tuple[str, str, int, int]


def walk(conn: psycopg.Connection, rows: Iterable[WalkedRow]) -> None:
    """Copy a scan's walk into its temporary table (dropped at commit: call inside a transaction),
    and create the table of observations it stages."""
    conn.execute(OBS.walk_create)
    with conn.cursor().copy(OBS.walk_copy) as copy:
        for row in rows:
            copy.write_row(row)
    conn.execute(OBS.stage_create)


def diff(conn: psycopg.Connection, root: str, in_buckets: tuple[Sequence[int], int] | None = None) -> None:
    """Compare the walk with the observations once (of the buckets ``in_buckets`` = (ids, count)
    when the walk holds only theirs); the statements below read only what differs."""
    if in_buckets is None:
        conn.execute(OBS.walk_diff, {"root": root})
    else:
        buckets, n = in_buckets
        conn.execute(OBS.walk_diff_in_buckets, {"root": root, "buckets": sorted(set(buckets)), "n": n})


def stage_listed(conn: psycopg.Connection) -> int:
    """Stage the walked items listed with a fingerprint that differs from their observation; how many."""
    return conn.execute(OBS.stage_listed).rowcount


def stage_unread(conn: psycopg.Connection, *, settled_before: int, unread: str) -> int:
    """Stage the new walked files modified before ``settled_before`` with a placeholder checksum
    (``unread``, size, '.', mtime), unread; how many."""
    return conn.execute(OBS.stage_unread, {"settled_before": settled_before, "unread": unread}).rowcount


def walked_to_read(conn: psycopg.Connection, *, settled_before: int, batch: int) -> Iterator[tuple[Any, ...]]:
    """(document id, size, mtime_ns, old checksum, old size, old mtime_ns) of the walked files the
    prefilter cannot vouch for, ``batch`` rows per fetch (other statements may run between two)."""
    with conn.cursor(name=TO_READ_CURSOR) as cur:
        cur.itersize = batch
        yield from cur.execute(OBS.walked_to_read, {"settled_before": settled_before})


def stage(conn: psycopg.Connection, rows: Sequence[StagedRow]) -> None:
    """Stage observations (after ``walk`` or ``record``'s table)."""
    if rows:
        with conn.cursor().copy(OBS.stage_copy) as copy:
            for row in rows:
                copy.write_row(row)


def walked_missing(conn: psycopg.Connection) -> list[str]:
    """Observed files the walk did not find (of the buckets ``diff`` compared)."""
    return [r[0] for r in conn.execute(OBS.walked_missing)]


def commit_staged(conn: psycopg.Connection, root: str, gone: Sequence[str]) -> None:
    """Upsert the staged observations and mark ``gone`` gone."""
    conn.execute(OBS.upsert_staged, {"root": root})
    if gone:
        conn.execute(OBS.mark_gone, {"root": root, "ids": list(gone)})


def record(conn: psycopg.Connection, root: str, rows: Sequence[StagedRow], gone: Sequence[str]) -> None:
    """Upsert observations and mark ``gone`` gone, in one transaction."""
    with conn.transaction():
        conn.execute(OBS.stage_create)
        stage(conn, rows)
        commit_staged(conn, root, gone)


def forget_gone(conn: psycopg.Connection, root: str, document_ids: Sequence[str]) -> None:
    """Drop the observations of gone files a bucket run tombstoned."""
    conn.execute(OBS.forget_gone, {"root": root, "ids": list(document_ids)})


def adopt(conn: psycopg.Connection, root: Path | str, docs: dict[str, str], generation: int) -> None:
    """Seed the observations from a legacy cursor map, as requested by ``generation``."""
    ids = sorted(docs)
    conn.execute(
        OBS.adopt, {"root": str(root), "ids": ids, "checksums": [docs[d] for d in ids], "generation": generation}
    )


def mark_synced_as_stored(conn: psycopg.Connection, root: Path | str, document_ids: Sequence[str]) -> None:
    """Documents ingested by id (not by a bucket run): their observations synced at the stored bytes."""
    conn.execute(OBS.mark_synced_as_stored, {"root": str(root), "ids": list(document_ids)})


def latest_generation(conn: psycopg.Connection, root: Path | str) -> int | None:
    return queries.scalar(conn, OBS.latest_generation, {"root": str(root)})


@dataclass(frozen=True)
class PendingBucket:
    bucket: int
    documents: int  # files pending in it (new, changed, gone)
    gone: int
    new: int  # never requested before
    digest: str  # of its pending (document, checksum) pairs


def pending_buckets(
    conn: psycopg.Connection, root: Path | str, generation: int, bucket_count: int
) -> list[PendingBucket]:
    """The buckets (of ``bucket_count``) holding what a tick starting from ``generation`` has to request."""
    rows = conn.execute(OBS.pending_buckets, {"root": str(root), "generation": generation, "n": bucket_count})
    return [PendingBucket(int(b), int(d), int(g), int(w), h) for b, d, g, w, h in rows.fetchall()]


def mark_buckets_requested(
    conn: psycopg.Connection, root: Path | str, bucket_ids: Iterable[int], bucket_count: int, generation: int
) -> None:
    """Every pending file of some buckets, as requested by ``generation``."""
    conn.execute(
        OBS.mark_requested_buckets,
        {"root": str(root), "generation": generation, "n": bucket_count, "buckets": sorted(set(bucket_ids))},
    )


@dataclass(frozen=True)
class Retries:
    """Files of ended, unsynced requests still waiting out their backoff."""

    waiting: int
    next_in: float | None  # seconds until the first is due (None: none waiting)


def schedule_retries(conn: psycopg.Connection, root: Path | str, generation: int, *, retry_base: float) -> Retries:
    """At a tick with none of the sensor's runs in flight (so every request of an earlier generation
    has ended): give the files those requests left unsynced their time to be requested again (after
    ``retry_base`` seconds, doubling per failed request, at most RETRY_CAP_SECONDS), and say how
    many still wait."""
    params = {"root": str(root), "generation": generation, "base": retry_base, "cap": RETRY_CAP_SECONDS}
    conn.execute(OBS.schedule_retries, params)
    row = conn.execute(OBS.waiting_retries, params).fetchone()
    waiting, next_in = row if row is not None else (0, None)
    return Retries(int(waiting), None if next_in is None else max(float(next_in), 0.0))


def retry_now(conn: psycopg.Connection, root: Path | str, document_ids: Sequence[str]) -> int:
    """Documents re-ingested behind the sensor's back (a reconciliation): those waiting out a
    failed request's backoff are due now, so their bucket run, which embeds them, comes next."""
    return conn.execute(OBS.retry_now, {"root": str(root), "ids": list(document_ids)}).rowcount


def unsync_unembedded(
    conn: psycopg.Connection, root: Path | str, first: int, last: int, bucket_count: int, model_id: str
) -> int:
    """After a failed or cancelled bucket run over ``first``..``last``: the files it synced whose
    document still lacks a vector of ``model_id`` are requested again like the files it did not
    sync (after the backoff). Returns how many."""
    return conn.execute(
        OBS.unsync_unembedded, {"root": str(root), "first": first, "last": last, "n": bucket_count, "model": model_id}
    ).rowcount
