"""What the source sensor observed, kept in PostgreSQL (app.source_observations).

* ``scan``: a file whose (size, mtime_ns) equal the stored ones is not read, nor a new one (an
  ``UNREAD`` placeholder checksum until its bucket run records its bytes'); changed files
  are hashed and upserted, missing ones marked gone; one modified within ``RACY_NS`` is read again.
* The observations' table (store/source_observations.py) also holds what a tick requests per
  bucket and the backoff before a failed request's files are requested again.

A rewrite keeping size and mtime (``cp -p``) is not seen; reconciliation repairs it (docs/dagster.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg

from pipeline_assets.content.folder_source import as_source
from pipeline_assets.content.source import CHECKSUM_HEX as CHECKSUM_HEX
from pipeline_assets.content.source import NOT_STATED, Observed, Source
from pipeline_assets.store import source_observations

RACY_NS = 2_000_000_000  # a file modified this close (ns) to its scan is read again on the next one
UNREAD = "~"  # starts the placeholder checksum of a new file no scan has read (never hex)
READ_BATCH = 2_000  # rows of files to read fetched at a time from the scan's comparison


def is_unread(checksum: str | None) -> bool:
    return checksum is not None and checksum.startswith(UNREAD)


@dataclass
class Scan:
    present: int = 0  # documents found
    hashed: int = 0  # files read (checksummed) by this scan
    unread: int = 0  # new files recorded without reading them (the bucket run reads them)
    written: int = 0  # observations written: new, changed, or re-verified (touched, racy)
    gone: int = 0  # documents marked gone by this scan
    unreadable: int = 0  # files that could not be read now (neither changed nor gone)
    empty_refused: int = 0  # the source is empty: this many present documents were NOT marked gone


def scan(
    conn: psycopg.Connection,
    source: Source | Path,
    *,
    max_bytes: int,
    keep: Callable[[str], bool] | None = None,
    in_buckets: tuple[Sequence[int], int] | None = None,
) -> Scan:
    """List ``source`` and bring its observations up to date; SourceError if it cannot be listed.

    An empty source marks nothing gone (``empty_refused``). ``keep``: only the documents it accepts are
    observed, and only they can be gone (a bucket run scans its own buckets); ``in_buckets`` (ids, count)
    says ``keep`` is exactly those buckets, so only their rows are compared and selected in the database.
    The listing is streamed into a temporary table and compared there: the scan holds only the items it
    must fingerprint (changed, racy), a batch at a time, and never reads an item whose listing carries a
    content token. A source with a change feed of its own (``follow_changes``: a table's change log)
    observes only what the feed names, and calls ``complete`` for a whole listing when the feed cannot
    vouch (its first scan, a TRUNCATE).
    """
    source = as_source(source)
    follow = getattr(source, "follow_changes", None)

    def complete() -> Scan:
        return _scan_all(conn, source, max_bytes=max_bytes, keep=keep, in_buckets=in_buckets)

    return complete() if follow is None else follow(conn, complete, keep)


def record_observed(conn: psycopg.Connection, root: str, present: Sequence[Observed], gone: Sequence[str]) -> Scan:
    """Observations from a change feed: ``present`` (each with its checksum) upserted, ``gone``
    marked gone; one transaction."""
    rows = [(o.document_id, o.checksum, o.size, o.mtime_ns) for o in present if o.checksum is not None]
    source_observations.record(conn, root, rows, gone)
    return Scan(present=len(rows), written=len(rows), gone=len(gone))


def _scan_all(
    conn: psycopg.Connection,
    source: Source,
    *,
    max_bytes: int,
    keep: Callable[[str], bool] | None,
    in_buckets: tuple[Sequence[int], int] | None,
) -> Scan:
    """``scan`` by a complete listing."""
    root_key = source.key
    started_ns = time.time_ns()
    settled_before = started_ns - RACY_NS
    result = Scan()
    refs: dict[str, object] = {}  # kept documents the source needs a handle to find again
    walked = 0

    def walked_rows() -> Iterator[source_observations.WalkedRow]:
        nonlocal walked
        # A bucket scan lets the source skip examining other buckets' items (NOT_STATED).
        for doc, size, mtime_ns, ref, checksum in source.observe(None if in_buckets is None else keep):
            kept = keep is None or (size != NOT_STATED and keep(doc))
            walked += 1
            if kept:
                result.present += 1
                if ref is not None:
                    refs[doc] = ref
            if kept or in_buckets is None:  # a bucket scan compares only its buckets' items
                yield doc, size, mtime_ns, kept, checksum

    with conn.transaction():
        source_observations.walk(conn, walked_rows())
        source_observations.diff(conn, root_key, in_buckets)
        # Listed with their fingerprint: compared here, nothing read.
        result.written += source_observations.stage_listed(conn)
        # New and settled: nothing to compare their bytes with; the run that ingests them reads them.
        result.unread = source_observations.stage_unread(conn, settled_before=settled_before, unread=UNREAD)
        rows: list[source_observations.StagedRow] = []
        for doc, size, mtime_ns, *old in source_observations.walked_to_read(
            conn, settled_before=settled_before, batch=READ_BATCH
        ):
            value = source.fingerprint(Observed(doc, size, mtime_ns, refs.get(doc)), max_bytes)
            result.hashed += 1
            if value is None:
                result.unreadable += 1  # look again next tick; the old observation stands
                continue
            mtime = mtime_ns if started_ns - mtime_ns > RACY_NS else 0
            if tuple(old) != (value, size, mtime):
                rows.append((doc, value, size, mtime))
                result.written += 1
            if len(rows) >= READ_BATCH:  # between two fetches of the cursor
                source_observations.stage(conn, rows)
                rows = []
        source_observations.stage(conn, rows)
        missing = source_observations.walked_missing(conn)
        gone = missing if keep is None or in_buckets is not None else [doc for doc in missing if keep(doc)]
        if not walked and gone:
            result.empty_refused, gone = len(gone), []
        source_observations.commit_staged(conn, root_key, gone)
    result.written += result.unread
    result.gone = len(gone)
    return result
