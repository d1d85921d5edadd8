"""The rows of document buckets (SQL: ``sql/queries/buckets.sql``): the database's bucket count,
fixed at its first use (``app.partition_scheme``); the stored bucket of rows written before it;
each bucket's documents, state and embedding coverage, grouped in the database; and what a
bucket run has to sync, then records as synced. The hash itself: ``app.buckets.bucket_of``
(the SQL function ``app.document_bucket``)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.store import queries
from pipeline_assets.store.reports import Coverage

BUCKETS = queries.load("buckets")

# Document ids listed per bucket in its metadata (quarantined, failed): bounds the
# size of one materialization event whatever the bucket holds.
SAMPLE_IDS = 20
# Rows one transaction of ``fill_buckets`` gives their stored bucket.
FILL_BATCH_ROWS = 10_000


class BucketCountMismatch(RuntimeError):
    """The configured bucket count is not the one the database was first used with."""


def selected(bucket_ids: Iterable[int], bucket_count: int) -> list[int] | None:
    """A statement's bucket filter: the buckets, or None (no filter) when they are all ``bucket_count``
    of them: one pass over the source then costs less than reading it through the bucket index."""
    chosen = sorted(set(bucket_ids))
    return None if len(chosen) >= bucket_count else chosen


def fixed_bucket_count(conn: psycopg.Connection, configured: int) -> int:
    """The database's bucket count; the first call on a database stores ``configured``."""
    conn.execute(BUCKETS.store_buckets, {"buckets": configured})
    return int(queries.scalar(conn, BUCKETS.stored_buckets))


def check_buckets(conn: psycopg.Connection, configured: int) -> int:
    """``configured`` if it is the database's bucket count, else BucketCountMismatch (one line)."""
    stored = fixed_bucket_count(conn, configured)
    if stored != configured:
        raise BucketCountMismatch(
            f"this database's documents are in {stored} buckets (fixed when it was first used), but "
            f"PIPELINE_PARTITION_BUCKETS is {configured}; set PIPELINE_PARTITION_BUCKETS={stored}"
        )
    return stored


def fill_buckets(pool: ConnectionPool) -> int:
    """Give the rows written without a stored bucket (before the scheme or the column existed)
    the scheme's, FILL_BATCH_ROWS per transaction (no long lock whatever the tables hold);
    how many, then their statistics. Statements hash a row without one: this only makes them cheaper."""
    filled = 0
    for statement in (BUCKETS.fill_document_buckets, BUCKETS.fill_observation_buckets):
        while True:
            with pool.connection() as conn:
                done = int(queries.scalar(conn, statement, {"limit": FILL_BATCH_ROWS}) or 0)
            filled += done
            if done < FILL_BATCH_ROWS:
                break
    if filled:
        with pool.connection() as conn:
            conn.execute(BUCKETS.analyze_buckets)
    return filled


def unsynced(
    conn: psycopg.Connection, root: str, bucket_ids: list[int] | None, bucket_count: int, *, after: str, limit: int
) -> list[tuple[str, str | None, bool]]:
    """One page of the files of some buckets (None: every one) a bucket run has not brought current:
    (document id, checksum or None when gone, whether the bytes are already the document's),
    the first ``limit`` past the document id ``after``."""
    return conn.execute(
        BUCKETS.unsynced, {"root": root, "n": bucket_count, "buckets": bucket_ids, "after": after, "limit": limit}
    ).fetchall()


def unobserved_current(
    conn: psycopg.Connection, root: str, bucket_ids: list[int] | None, bucket_count: int
) -> list[str]:
    """Documents of some buckets, not quarantined or deleted, without an observed file."""
    return [
        r[0] for r in conn.execute(BUCKETS.unobserved_current, {"root": root, "n": bucket_count, "buckets": bucket_ids})
    ]


def live_versions(conn: psycopg.Connection, root: str) -> set[tuple[str, str, str]]:
    """The distinct (extractor version, chunker version, extension) of the source's live documents
    ('' for none; the extension lower case, with its dot): a few index descents, not a read of them."""
    return {(e, c, x) for e, c, x in conn.execute(BUCKETS.live_versions, {"root": root})}


def mark_synced(conn: psycopg.Connection, root: str, synced: dict[str, str]) -> None:
    """The files a bucket run brought current, at the checksum it saw ({document id: checksum})."""
    ids = list(synced)
    conn.execute(BUCKETS.mark_synced, {"root": root, "ids": ids, "checksums": [synced[d] for d in ids]})


def resolve_unread(conn: psycopg.Connection, root: str, unread: dict[str, str]) -> None:
    """Files listed unread ({document id: placeholder checksum}), now ingested: their checksum
    becomes that of the bytes ingested, synced."""
    ids = list(unread)
    conn.execute(BUCKETS.resolve_unread, {"root": root, "ids": ids, "checksums": [unread[d] for d in ids]})


def digest(parts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\x1e")
    return h.hexdigest()


@dataclass
class BucketState:
    """One bucket's documents and chunks, as its Dagster partition's metadata shows them."""

    documents: int = 0
    current: int = 0
    quarantined: int = 0
    chunks: int = 0
    tokens: int = 0
    text_digest: str = ""  # the documents' text checksums (quarantines: why), by id
    chunks_digest: str = ""  # the documents' chunk digests, by id
    quarantined_ids: list[str] = field(default_factory=list)  # the first SAMPLE_IDS, by id


def states_of(
    conn: psycopg.Connection, root: str, bucket_ids: Sequence[int], bucket_count: int
) -> dict[int, BucketState]:
    """Each bucket's state (every bucket asked for, empty or not), grouped in the database:
    the same values as computing them from the documents' summaries."""
    empty = digest([])
    out = {b: BucketState(text_digest=empty, chunks_digest=empty) for b in bucket_ids}
    for b, docs, current, quarantined, chunks, tokens, text_digest, chunks_digest, sample in conn.execute(
        BUCKETS.bucket_states, {**_filter(root, bucket_ids, bucket_count), "sample": SAMPLE_IDS}
    ):
        out[int(b)] = BucketState(
            int(docs),
            int(current),
            int(quarantined),
            int(chunks),
            int(tokens),
            text_digest,
            chunks_digest,
            list(sample),
        )
    return out


@dataclass
class BucketCoverage:
    """One bucket's embedding state for a model (per document, summed)."""

    chunks: int = 0
    ready: int = 0
    failed: int = 0
    waiting: int = 0
    failed_ids: list[str] = field(default_factory=list)  # documents with a failed chunk, the first SAMPLE_IDS


def coverage_of_buckets(
    conn: psycopg.Connection, root: str, bucket_ids: Sequence[int], bucket_count: int, model_id: str
) -> dict[int, BucketCoverage]:
    """Each bucket's coverage for a model, grouped in the database (one row per bucket)."""
    return coverage_and_total(conn, root, bucket_ids, bucket_count, model_id)[0]


def coverage_and_total(
    conn: psycopg.Connection, root: str, bucket_ids: Sequence[int], bucket_count: int, model_id: str
) -> tuple[dict[int, BucketCoverage], Coverage]:
    """Each bucket's coverage for a model, and the total over their distinct chunks (one query)."""
    out = {b: BucketCoverage() for b in bucket_ids}
    total = Coverage(0, 0, 0, 0)
    for b, chunks, ready, failed, waiting, failed_ids in conn.execute(
        BUCKETS.bucket_coverage, {**_filter(root, bucket_ids, bucket_count), "model": model_id, "sample": SAMPLE_IDS}
    ):
        if b is None:
            total = Coverage(int(chunks), int(ready), int(failed), int(waiting))
        else:
            out[int(b)] = BucketCoverage(int(chunks), int(ready), int(failed), int(waiting), sorted(failed_ids))
    return out, total


def estimated_documents(conn: psycopg.Connection, root: str, bucket_ids: Sequence[int], bucket_count: int) -> int:
    """About how many documents some buckets hold: the source's count times their share (the
    hash spreads ids evenly); one count, no hash per row."""
    total = int(queries.scalar(conn, BUCKETS.source_documents, {"root": root}) or 0)
    return total * len(set(bucket_ids)) // bucket_count


def current_pks(conn: psycopg.Connection, root: str, bucket_ids: Sequence[int], bucket_count: int) -> array[int]:
    """The keys of the source's current documents in some buckets, 8 bytes each (not one Python int
    each: a run over every bucket of a million documents holds them for its whole wait)."""
    return array("q", (r[0] for r in conn.execute(BUCKETS.bucket_current_pks, _filter(root, bucket_ids, bucket_count))))


def _filter(root: str, bucket_ids: Sequence[int], bucket_count: int) -> dict[str, Any]:
    """The parameters selecting a source's rows in some buckets."""
    return {"root": root, "n": bucket_count, "buckets": selected(bucket_ids, bucket_count)}
