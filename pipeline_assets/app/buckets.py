"""Document buckets: the unit the Dagster layer works in.

A document belongs to bucket ``sha256(document_id)[:60 bits] % n`` (also the SQL function
``app.document_bucket``): an edit keeps its bucket, and ``n`` is fixed by a database's first use
(``app.partition_scheme``), so partitions never grow with the corpus.

``sync_buckets``, the use case of a bucket run, brings some buckets current with the source and the
code: it scans their files with the observations' prefilter, ingests what is new, changed or stale
(another code version) and tombstones what is gone, then records what it synced. Unchanged content
is never re-extracted, and unchanged chunks keep their jobs: no provider call for them.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import observations
from pipeline_assets.app import rerun as rerun_uc
from pipeline_assets.app.ingest import IngestReport, ingest_documents
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.content.folder_source import as_source
from pipeline_assets.content.source import Source
from pipeline_assets.store import queries, reports, source_observations

BUCKETS = queries.load("buckets")

# Bits of sha256(document_id) the bucket is taken from (a positive bigint in SQL).
BUCKET_HASH_HEX = 15
# Document ids listed per bucket in its metadata (quarantined, failed): bounds the
# size of one materialization event whatever the bucket holds.
SAMPLE_IDS = 20
# Documents one step of a bucket run reads, ingests and records before the next (unsynced
# files, stale documents): bounds the run's memory (about 1 kB per document in flight)
# whatever its buckets hold.
SYNC_PAGE_DOCUMENTS = 10_000
# Rows one transaction of ``fill_buckets`` gives their stored bucket.
FILL_BATCH_ROWS = 10_000
_DROPPED_BITS = 64 - 4 * BUCKET_HASH_HEX


class BucketCountMismatch(RuntimeError):
    """The configured bucket count is not the one the database was first used with."""


def selected(buckets: Iterable[int], n: int) -> list[int] | None:
    """A statement's bucket filter: the buckets, or None (no filter) when they are all ``n``
    of them: one pass over the source then costs less than reading it through the bucket index."""
    chosen = sorted(set(buckets))
    return None if len(chosen) >= n else chosen


def bucket_of(document_id: str, buckets: int) -> int:
    """The bucket of a document id (the same as SQL's app.document_bucket): the first
    BUCKET_HASH_HEX hex digits of the sha256 are the first 8 bytes less their last 4 bits."""
    head = hashlib.sha256(document_id.encode("utf-8", "surrogateescape")).digest()[:8]
    return (int.from_bytes(head, "big") >> _DROPPED_BITS) % buckets


def fixed_buckets(conn: psycopg.Connection, configured: int) -> int:
    """The database's bucket count; the first call on a database stores ``configured``."""
    conn.execute(BUCKETS.store_buckets, {"buckets": configured})
    return int(queries.scalar(conn, BUCKETS.stored_buckets))


def check_buckets(conn: psycopg.Connection, configured: int) -> int:
    """``configured`` if it is the database's bucket count, else BucketCountMismatch (one line)."""
    stored = fixed_buckets(conn, configured)
    if stored != configured:
        raise BucketCountMismatch(
            f"this database's documents are in {stored} buckets (fixed when it was first used), but "
            f"PIPELINE_PARTITION_BUCKETS is {configured}; set PIPELINE_PARTITION_BUCKETS={stored}")
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


def buckets_of(document_ids: Iterable[str], buckets: int) -> dict[int, list[str]]:
    """The ids grouped by bucket, in their order."""
    out: dict[int, list[str]] = defaultdict(list)
    for doc in document_ids:
        out[bucket_of(doc, buckets)].append(doc)
    return dict(out)


@dataclass
class BucketSync:
    """What a bucket run did (counts: a run over a million documents holds no list of them)."""

    scan: observations.Scan
    changed: int = 0    # new or changed bytes: ingested
    stale: int = 0      # another extractor/chunker version: re-extracted
    gone: int = 0       # files gone: tombstoned
    report: IngestReport = field(default_factory=IngestReport)


def sync_buckets(rt: Runtime, pool: ConnectionPool, source: Source | Path, buckets: Sequence[int], n: int, *,
                 source_changes: bool = True) -> BucketSync:
    """Bring the documents of ``buckets`` (of ``n``) current with the source and the code.

    ``source_changes=False`` (the rerun sensor's run after a code fix): only the stale
    documents are re-extracted; the source is not scanned, and what changed in it is
    the source sensor's next run. The work goes in pages of SYNC_PAGE_DOCUMENTS documents,
    each read, ingested and recorded before the next: a run's memory is bounded by a page,
    not by what its buckets hold."""
    source = as_source(source)
    root = source.key
    wanted = set(buckets)
    chosen = selected(wanted, n)
    every = chosen is None
    params = {"root": root, "n": n, "buckets": chosen}
    done = BucketSync(scan=observations.Scan())
    with pool.connection() as conn:
        check_buckets(conn, n)
    fill_buckets(pool)
    with pool.connection() as conn:
        if source_changes:
            done.scan = observations.scan(
                conn, source, max_bytes=rt.settings.max_input_bytes,
                keep=None if every else lambda doc: bucket_of(doc, n) in wanted,
                buckets=None if every else (sorted(wanted), n))
        else:
            source.check()
    if source_changes:
        after = ""
        while True:
            with pool.connection() as conn:
                rows = conn.execute(BUCKETS.unsynced, {**params, "after": after,
                                                       "limit": SYNC_PAGE_DOCUMENTS}).fetchall()
            if not rows:
                break
            after = rows[-1][0]
            _sync_page(rt, pool, source, rows, done)
        if not done.scan.empty_refused:
            with pool.connection() as conn:
                orphans = [r[0] for r in conn.execute(BUCKETS.unobserved_current, params)]
            for page in _pages(orphans):
                done.report.add(ingest_documents(rt, pool, source, page))
            done.gone += len(orphans)
    # After the changed documents: those are current now, and only the rest is stale. Selected in
    # the database for this source and these buckets, a page at a time (the extract pass brings a
    # document's chunk stage current too, so the chunk pass finds only what is stale there alone).
    for stage in rerun_uc.VERSIONED_STAGES:
        for targets in rerun_uc.pages(rt, pool, stages_=(stage,), stale=True, root=root, buckets=chosen,
                                      n=n, page_size=SYNC_PAGE_DOCUMENTS):
            done.report.add(ingest_documents(rt, pool, source, [t.document_id for t in targets]))
            done.stale += len(targets)
    return done


def _sync_page(rt: Runtime, pool: ConnectionPool, source: Source, rows: list[tuple[str, str | None, bool]],
               done: BucketSync) -> None:
    """One page of unsynced observations: ingest the new or changed files and tombstone the gone
    ones, then record the page as synced (a new file at the checksum of the bytes ingested)."""
    changed = {doc: checksum for doc, checksum, in_store in rows if checksum is not None and not in_store}
    current = {doc: checksum for doc, checksum, in_store in rows if checksum is not None and in_store}
    gone = [doc for doc, checksum, _ in rows if checksum is None]
    # Files whose bytes are already their document's need no ingest (the command line
    # ingested them); a stale one among them is re-extracted as stale.
    todo = [*changed, *gone]
    if todo:
        done.report.add(ingest_documents(rt, pool, source, todo))
    root = source.key
    with pool.connection() as conn:
        synced = {**changed, **current}
        if synced:
            ids = list(synced)
            conn.execute(BUCKETS.mark_synced, {"root": root, "ids": ids, "checksums": [synced[d] for d in ids]})
        unread = [d for d in changed if observations.is_unread(changed[d])]
        if unread:
            conn.execute(BUCKETS.resolve_unread, {"root": root, "ids": unread,
                                                  "checksums": [changed[d] for d in unread]})
        if gone:
            source_observations.forget_gone(conn, root, gone)
    done.changed += len(changed)
    done.gone += len(gone)


def _pages(ids: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(ids), SYNC_PAGE_DOCUMENTS):
        yield ids[i:i + SYNC_PAGE_DOCUMENTS]


def bucket_documents(conn: psycopg.Connection, root: str, buckets: Sequence[int], n: int) -> list[str]:
    """The source's documents (current or quarantined) in some buckets."""
    return [r[0] for r in conn.execute(BUCKETS.bucket_documents,
                                       {"root": root, "n": n, "buckets": selected(buckets, n)})]


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
    text_digest: str = ""       # the documents' text checksums (quarantines: why), by id
    chunks_digest: str = ""     # the documents' chunk digests, by id
    quarantined_ids: list[str] = field(default_factory=list)   # the first SAMPLE_IDS, by id


def states_of(conn: psycopg.Connection, root: str, buckets: Sequence[int], n: int) -> dict[int, BucketState]:
    """Each bucket's state (every bucket asked for, empty or not), grouped in the database:
    the same values as computing them from the documents' summaries."""
    empty = digest([])
    out = {b: BucketState(text_digest=empty, chunks_digest=empty) for b in buckets}
    for b, docs, current, quarantined, chunks, tokens, text_digest, chunks_digest, sample in conn.execute(
            BUCKETS.bucket_states, {"root": root, "n": n, "buckets": selected(buckets, n), "sample": SAMPLE_IDS}):
        out[int(b)] = BucketState(int(docs), int(current), int(quarantined), int(chunks), int(tokens),
                                  text_digest, chunks_digest, list(sample))
    return out


@dataclass
class BucketCoverage:
    """One bucket's embedding state for a model (per document, summed)."""

    chunks: int = 0
    ready: int = 0
    failed: int = 0
    waiting: int = 0
    failed_ids: list[str] = field(default_factory=list)   # documents with a failed chunk, the first SAMPLE_IDS


def coverage_of_buckets(conn: psycopg.Connection, root: str, buckets: Sequence[int], n: int,
                        model_id: str) -> dict[int, BucketCoverage]:
    """Each bucket's coverage for a model, grouped in the database (one row per bucket)."""
    return coverage_and_total(conn, root, buckets, n, model_id)[0]


def coverage_and_total(conn: psycopg.Connection, root: str, buckets: Sequence[int], n: int,
                       model_id: str) -> tuple[dict[int, BucketCoverage], reports.Coverage]:
    """Each bucket's coverage for a model, and the total over their distinct chunks (one query)."""
    out = {b: BucketCoverage() for b in buckets}
    total = reports.Coverage(0, 0, 0, 0)
    for b, chunks, ready, failed, waiting, failed_ids in conn.execute(BUCKETS.bucket_coverage, {
            "root": root, "n": n, "buckets": selected(buckets, n), "model": model_id, "sample": SAMPLE_IDS}):
        if b is None:
            total = reports.Coverage(int(chunks), int(ready), int(failed), int(waiting))
        else:
            out[int(b)] = BucketCoverage(int(chunks), int(ready), int(failed), int(waiting), sorted(failed_ids))
    return out, total


def estimated_documents(conn: psycopg.Connection, root: str, buckets: Sequence[int], n: int) -> int:
    """About how many documents some buckets hold: the source's count times their share (the
    hash spreads ids evenly); one count, no hash per row."""
    total = int(queries.scalar(conn, BUCKETS.source_documents, {"root": root}) or 0)
    return total * len(set(buckets)) // n


def current_pks(conn: psycopg.Connection, root: str, buckets: Sequence[int], n: int) -> list[int]:
    """The keys of the source's current documents in some buckets."""
    return [r[0] for r in conn.execute(BUCKETS.bucket_current_pks,
                                       {"root": root, "n": n, "buckets": selected(buckets, n)})]


def bucket_coverage(per_document: dict[str, reports.Coverage], buckets: Sequence[int],
                    n: int) -> dict[int, BucketCoverage]:
    out = {b: BucketCoverage() for b in buckets}
    for doc in sorted(per_document):
        cov = per_document[doc]
        b = out.setdefault(bucket_of(doc, n), BucketCoverage())
        b.chunks += cov.wanted
        b.ready += cov.ready
        b.failed += cov.failed
        b.waiting += cov.waiting
        if cov.failed and len(b.failed_ids) < SAMPLE_IDS:
            b.failed_ids.append(doc)
    return out
