"""What the source sensor observed, kept in PostgreSQL (app.source_observations).

* ``scan``: a file whose (size, mtime_ns) equal the stored ones is not read, nor a new one (an
  ``unread_checksum`` placeholder until its bucket run records its bytes' checksum); changed files
  are hashed and upserted, missing ones marked gone; one modified within ``RACY_NS`` is read again.
* ``pending_buckets`` / ``mark_buckets_requested``: the buckets a tick has to request, and what it did.
* ``schedule_retries``: files of a run that ended without syncing (or embedding) them are requested
  again after ``RETRY_BASE_SECONDS``, doubling, at most ``RETRY_CAP_SECONDS``.

A rewrite keeping size and mtime (``cp -p``) is not seen; reconciliation repairs it (docs/dagster.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg

from pipeline_assets.content.folder_source import as_source
from pipeline_assets.content.source import CHECKSUM_HEX as CHECKSUM_HEX
from pipeline_assets.content.source import NOT_STATED, Observed, Source
from pipeline_assets.store import queries

OBS = queries.load("observations")

RACY_NS = 2_000_000_000          # a file modified this close (ns) to its scan is read again on the next one
UNREAD = "~"                     # starts the placeholder checksum of a new file no scan has read (never hex)
READ_BATCH = 2_000               # rows of files to read fetched at a time from the scan's comparison
# A file whose requested run ended without syncing it is requested again after
# RETRY_BASE_SECONDS, then twice as long after each further failed request of the
# same bytes, at most RETRY_CAP_SECONDS: a persistently failing run is retried
# about once an hour, not at every tick.
RETRY_BASE_SECONDS = 60.0
RETRY_CAP_SECONDS = 3600.0


def unread_checksum(size: int, mtime_ns: int) -> str:
    """The placeholder observation of a new file that was listed but not read."""
    return f"{UNREAD}{size}.{mtime_ns}"


def is_unread(checksum: str | None) -> bool:
    return checksum is not None and checksum.startswith(UNREAD)


@dataclass
class Scan:
    present: int = 0          # documents found
    hashed: int = 0           # files read (checksummed) by this scan
    unread: int = 0           # new files recorded without reading them (the bucket run reads them)
    written: int = 0          # observations written: new, changed, or re-verified (touched, racy)
    gone: int = 0             # documents marked gone by this scan
    unreadable: int = 0       # files that could not be read now (neither changed nor gone)
    empty_refused: int = 0    # the source is empty: this many present documents were NOT marked gone


def scan(conn: psycopg.Connection, source: Source | Path, *, max_bytes: int,
         keep: Callable[[str], bool] | None = None, buckets: tuple[Sequence[int], int] | None = None) -> Scan:
    """List ``source`` and bring its observations up to date. Raises SourceError if it
    cannot be listed. An empty source does not mark everything gone (``empty_refused``).
    ``keep``: only the documents it accepts are observed (and only they can be gone):
    a bucket run scans its own buckets. ``buckets`` (ids, count): ``keep`` is exactly
    membership of those buckets, so only their files are compared in the database and
    only their observations can be gone (selected in the database): past the walk's
    listing, the scan costs what the buckets hold.

    The listing is streamed into a temporary table and compared with the stored observations
    there: the scan holds no row per item, only the items it has to fingerprint (changed,
    racy) one batch at a time, and the handles of those few the source cannot find by id
    (a folder's symlinks and escaped names). An item whose listing carries its fingerprint
    (a content token) is compared in the database and never read.

    A source with a change feed of its own (``follow_changes``: a table's change log)
    observes only what the feed names, and calls ``complete`` for a complete listing
    when the feed cannot vouch (its first scan, a TRUNCATE)."""
    source = as_source(source)
    follow = getattr(source, "follow_changes", None)
    if follow is not None:
        return follow(conn, lambda: _scan_all(conn, source, max_bytes=max_bytes, keep=keep, buckets=buckets), keep)
    return _scan_all(conn, source, max_bytes=max_bytes, keep=keep, buckets=buckets)


def record_observed(conn: psycopg.Connection, root: str, present: Sequence[Observed], gone: Sequence[str]) -> Scan:
    """Observations from a change feed: ``present`` (each with its checksum) upserted, ``gone``
    marked gone; one transaction."""
    rows = [(o.document_id, o.checksum, o.size, o.mtime_ns) for o in present if o.checksum is not None]
    with conn.transaction():
        conn.execute(OBS.stage_create)
        _stage(conn, rows)
        conn.execute(OBS.upsert_staged, {"root": root})
        if gone:
            conn.execute(OBS.mark_gone, {"root": root, "ids": list(gone)})
    return Scan(present=len(rows), written=len(rows), gone=len(gone))


def _scan_all(conn: psycopg.Connection, source: Source, *, max_bytes: int,
              keep: Callable[[str], bool] | None, buckets: tuple[Sequence[int], int] | None) -> Scan:
    """``scan`` by a complete listing."""
    root_key = source.key
    started_ns = time.time_ns()
    result = Scan()
    refs: dict[str, object] = {}    # kept documents the source needs a handle to find again
    walked = 0
    params = {"root": root_key, "settled_before": started_ns - RACY_NS, "unread": UNREAD}
    with conn.transaction():
        conn.execute(OBS.walk_create)
        with conn.cursor().copy(OBS.walk_copy) as copy:
            # A bucket scan lets the source skip examining other buckets' items (NOT_STATED).
            for doc, size, mtime_ns, ref, checksum in source.observe(None if buckets is None else keep):
                kept = keep is None or (size != NOT_STATED and keep(doc))
                walked += 1
                if kept:
                    result.present += 1
                    if ref is not None:
                        refs[doc] = ref
                if kept or buckets is None:   # a bucket scan compares only its buckets' items
                    copy.write_row((doc, size, mtime_ns, kept, checksum))
        conn.execute(OBS.walk_analyze)
        conn.execute(OBS.stage_create)
        # Listed with their fingerprint: compared here, nothing read.
        result.written += conn.execute(OBS.stage_listed, params).rowcount
        # New and settled: nothing to compare their bytes with; the run that ingests them reads them.
        result.unread = conn.execute(OBS.stage_unread, params).rowcount
        rows: list[tuple[str, str, int, int]] = []
        with conn.cursor(name="observations_to_read") as cur:
            cur.itersize = READ_BATCH
            for doc, size, mtime_ns, *old in cur.execute(OBS.walked_to_read, params):
                value = source.fingerprint(Observed(doc, size, mtime_ns, refs.get(doc)), max_bytes)
                result.hashed += 1
                if value is None:
                    result.unreadable += 1   # look again next tick; the old observation stands
                    continue
                mtime = mtime_ns if started_ns - mtime_ns > RACY_NS else 0
                if tuple(old) != (value, size, mtime):
                    rows.append((doc, value, size, mtime))
                    result.written += 1
                if len(rows) >= READ_BATCH:   # between two fetches of the cursor
                    _stage(conn, rows)
                    rows = []
        _stage(conn, rows)
        if buckets is None:
            missing = [r[0] for r in conn.execute(OBS.walked_missing, params)]
            gone = missing if keep is None else [doc for doc in missing if keep(doc)]
        else:
            gone = [r[0] for r in conn.execute(OBS.walked_missing_in_buckets, {
                **params, "buckets": sorted(set(buckets[0])), "n": buckets[1]})]
        if not walked and gone:
            result.empty_refused, gone = len(gone), []
        conn.execute(OBS.upsert_staged, {"root": root_key})
        if gone:
            conn.execute(OBS.mark_gone, {"root": root_key, "ids": gone})
    result.written += result.unread
    result.gone = len(gone)
    return result


def _stage(conn: psycopg.Connection, rows: list[tuple[str, str, int, int]]) -> None:
    if rows:
        with conn.cursor().copy(OBS.stage_copy) as copy:
            for row in rows:
                copy.write_row(row)


def adopt(conn: psycopg.Connection, root: Path | str, docs: dict[str, str], generation: int) -> None:
    """Seed the observations from a legacy cursor map, as requested by ``generation``."""
    ids = sorted(docs)
    conn.execute(OBS.adopt, {"root": str(root), "ids": ids, "checksums": [docs[d] for d in ids],
                             "generation": generation})


def mark_synced_as_stored(conn: psycopg.Connection, root: Path | str, document_ids: Sequence[str]) -> None:
    """Documents ingested by id (not by a bucket run): their observations synced at the stored bytes."""
    conn.execute(OBS.mark_synced_as_stored, {"root": str(root), "ids": list(document_ids)})


def latest_generation(conn: psycopg.Connection, root: Path | str) -> int | None:
    return queries.scalar(conn, OBS.latest_generation, {"root": str(root)})


@dataclass(frozen=True)
class PendingBucket:
    bucket: int
    documents: int            # files pending in it (new, changed, gone)
    gone: int
    new: int                  # never requested before
    digest: str               # of its pending (document, checksum) pairs


def pending_buckets(conn: psycopg.Connection, root: Path | str, generation: int, buckets: int) -> list[PendingBucket]:
    """The buckets (of ``buckets``) holding what a tick starting from ``generation`` has to request."""
    rows = conn.execute(OBS.pending_buckets, {"root": str(root), "generation": generation, "n": buckets})
    return [PendingBucket(int(b), int(d), int(g), int(w), h) for b, d, g, w, h in rows.fetchall()]


def mark_buckets_requested(conn: psycopg.Connection, root: Path | str, bucket_ids: Iterable[int], buckets: int,
                           generation: int) -> None:
    """Every pending file of some buckets, as requested by ``generation``."""
    conn.execute(OBS.mark_requested_buckets, {"root": str(root), "generation": generation, "n": buckets,
                                              "buckets": sorted(set(bucket_ids))})


@dataclass(frozen=True)
class Retries:
    """Files of ended, unsynced requests still waiting out their backoff."""

    waiting: int
    next_in: float | None     # seconds until the first is due (None: none waiting)


def schedule_retries(conn: psycopg.Connection, root: Path | str, generation: int) -> Retries:
    """At a tick with none of the sensor's runs in flight (so every request of an earlier generation
    has ended): give the files those requests left unsynced their time to be requested again, and
    say how many still wait."""
    params = {"root": str(root), "generation": generation, "base": RETRY_BASE_SECONDS, "cap": RETRY_CAP_SECONDS}
    conn.execute(OBS.schedule_retries, params)
    row = conn.execute(OBS.waiting_retries, params).fetchone()
    waiting, next_in = row if row is not None else (0, None)
    return Retries(int(waiting), None if next_in is None else max(float(next_in), 0.0))


def retry_now(conn: psycopg.Connection, root: Path | str, document_ids: Sequence[str]) -> int:
    """Documents re-ingested behind the sensor's back (a reconciliation): those waiting out a
    failed request's backoff are due now, so their bucket run, which embeds them, comes next."""
    return conn.execute(OBS.retry_now, {"root": str(root), "ids": list(document_ids)}).rowcount


def unsync_unembedded(conn: psycopg.Connection, root: Path | str, first: int, last: int, buckets: int,
                      model_id: str) -> int:
    """After a failed or cancelled bucket run over ``first``..``last``: the files it synced whose
    document still lacks a vector of ``model_id`` are requested again like the files it did not
    sync (after the backoff). Returns how many."""
    return conn.execute(OBS.unsync_unembedded, {"root": str(root), "first": first, "last": last, "n": buckets,
                                                "model": model_id}).rowcount
