"""Document buckets: the unit the Dagster layer works in.

A document belongs to bucket ``sha256(document_id)[:60 bits] % bucket_count`` (also the SQL
function ``app.document_bucket``): an edit keeps its bucket, and the count is fixed by a database's
first use (``app.partition_scheme``), so partitions never grow with the corpus. The buckets' rows:
store/bucket_rows.py.

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
from pipeline_assets.app.ingest import ingest_documents
from pipeline_assets.app.ingest_batches import IngestReport
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.content.folder_source import as_source
from pipeline_assets.content.source import Source
from pipeline_assets.store import bucket_rows, source_observations
from pipeline_assets.store.bucket_rows import SAMPLE_IDS, BucketCoverage
from pipeline_assets.store.reports import Coverage

# Bits of sha256(document_id) the bucket is taken from (a positive bigint in SQL).
BUCKET_HASH_HEX = 15
# Documents one step of a bucket run reads, ingests and records before the next (unsynced
# files, stale documents): bounds the run's memory (about 1 kB per document in flight)
# whatever its buckets hold.
SYNC_PAGE_DOCUMENTS = 10_000
# Documents a bucket run lists by id (``BucketSync.documents``) for the embeddings after it;
# past this many it lists none, and they embed its buckets whole.
LISTED_DOCUMENTS = 2_000
_DROPPED_BITS = 64 - 4 * BUCKET_HASH_HEX


def bucket_of(document_id: str, bucket_count: int) -> int:
    """The bucket of a document id (the same as SQL's app.document_bucket): the first
    BUCKET_HASH_HEX hex digits of the sha256 are the first 8 bytes less their last 4 bits."""
    head = hashlib.sha256(document_id.encode("utf-8", "surrogateescape")).digest()[:8]
    return (int.from_bytes(head, "big") >> _DROPPED_BITS) % bucket_count


def buckets_of(document_ids: Iterable[str], bucket_count: int) -> dict[int, list[str]]:
    """The ids grouped by bucket, in their order."""
    out: dict[int, list[str]] = defaultdict(list)
    for doc in document_ids:
        out[bucket_of(doc, bucket_count)].append(doc)
    return dict(out)


@dataclass
class BucketSync:
    """What a bucket run did: counts, and the documents by id only up to LISTED_DOCUMENTS (a run
    over a million documents holds no list of them)."""

    scan: observations.Scan
    changed: int = 0  # new or changed bytes: ingested
    stale: int = 0  # another extractor/chunker version: re-extracted
    gone: int = 0  # files gone: tombstoned
    report: IngestReport = field(default_factory=IngestReport)
    # Every document it ingested, recorded or tombstoned, by id; None past LISTED_DOCUMENTS.
    documents: list[str] | None = field(default_factory=list)

    def touched(self, ids: Iterable[str]) -> None:
        if self.documents is not None:
            self.documents.extend(ids)
            if len(self.documents) > LISTED_DOCUMENTS:
                self.documents = None


def sync_buckets(
    rt: Runtime,
    pool: ConnectionPool,
    source: Source | Path,
    bucket_ids: Sequence[int],
    bucket_count: int,
    *,
    source_changes: bool = True,
    observed: bool = False,
) -> BucketSync:
    """Bring the documents of ``bucket_ids`` (of ``bucket_count``) current with the source and the code.

    ``source_changes=False`` (the rerun sensor's run after a code fix): only the stale
    documents are re-extracted; the source is not scanned, and what changed in it is
    the source sensor's next run. ``observed`` (the source sensor's run): the sensor's tick
    has just scanned the source, so there is no walk: the files its observations hold unsynced
    in ``bucket_ids`` are synced, and their documents without an observed file tombstoned.
    The work goes in pages of SYNC_PAGE_DOCUMENTS documents, each read, ingested and recorded
    before the next: a run's memory is bounded by a page, not by what its buckets hold."""
    source = as_source(source)
    root = source.key
    wanted = set(bucket_ids)
    chosen = bucket_rows.selected(wanted, bucket_count)
    every = chosen is None
    done = BucketSync(scan=observations.Scan())
    with pool.connection() as conn:
        bucket_rows.check_buckets(conn, bucket_count)
    bucket_rows.fill_buckets(pool)
    with pool.connection() as conn:
        if source_changes and not observed:
            done.scan = observations.scan(
                conn,
                source,
                max_bytes=rt.settings.max_input_bytes,
                keep=None if every else lambda doc: bucket_of(doc, bucket_count) in wanted,
                in_buckets=None if every else (sorted(wanted), bucket_count),
            )
        else:
            source.check()
    if source_changes:
        after = ""
        while True:
            with pool.connection() as conn:
                rows = bucket_rows.unsynced(conn, root, chosen, bucket_count, after=after, limit=SYNC_PAGE_DOCUMENTS)
            if not rows:
                break
            after = rows[-1][0]
            _sync_page(rt, pool, source, rows, done)
        if not done.scan.empty_refused:
            with pool.connection() as conn:
                orphans = [] if chosen == [] else bucket_rows.unobserved_current(conn, root, chosen, bucket_count)
            for page in _pages(orphans):
                done.report.add(ingest_documents(rt, pool, source, page))
                done.touched(page)
            done.gone += len(orphans)
    # After the changed documents: those are current now, and only the rest is stale. Selected in
    # the database for this source and these buckets, a page at a time (the extract pass brings a
    # document's chunk stage current too, so the chunk pass finds only what is stale there alone),
    # for the stages where some live document of the source has another version at all.
    with pool.connection() as conn:
        stages = stale_stages(rt, conn, root)
    for stage in stages:
        for targets in rerun_uc.pages(
            rt,
            pool,
            stages_=(stage,),
            stale=True,
            root=root,
            bucket_ids=chosen,
            bucket_count=bucket_count,
            page_size=SYNC_PAGE_DOCUMENTS,
        ):
            ids = [t.document_id for t in targets]
            done.report.add(ingest_documents(rt, pool, source, ids))
            done.touched(ids)
            done.stale += len(targets)
    return done


def stale_stages(rt: Runtime, conn: psycopg.Connection, root: str) -> tuple[str, ...]:
    """The versioned stages (extract, chunk) in which some live document of the source may have
    another version than the current one (for extract, its extension's): from the distinct
    versions the documents carry (``bucket_rows.live_versions``), without reading them. A stage
    left out has no stale document; one listed may (``rerun_uc.pages`` selects them)."""
    versions = rt.options.extractor_version
    by_extension, default = versions.by_extension(), versions.default
    present = bucket_rows.live_versions(conn, root)
    out = []
    if any(extract != by_extension.get(ext, default) for extract, _, ext in present):
        out.append("extract")
    if any(chunk != rt.options.chunker.version for _, chunk, _ in present):
        out.append("chunk")
    return tuple(stage for stage in rerun_uc.VERSIONED_STAGES if stage in out)


def _sync_page(
    rt: Runtime, pool: ConnectionPool, source: Source, rows: list[tuple[str, str | None, bool]], done: BucketSync
) -> None:
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
            bucket_rows.mark_synced(conn, root, synced)
        unread = {d: checksum for d, checksum in changed.items() if observations.is_unread(checksum)}
        if unread:
            bucket_rows.resolve_unread(conn, root, unread)
        if gone:
            source_observations.forget_gone(conn, root, gone)
    done.changed += len(changed)
    done.gone += len(gone)
    done.touched(doc for doc, _, _ in rows)


def _pages(ids: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(ids), SYNC_PAGE_DOCUMENTS):
        yield ids[i : i + SYNC_PAGE_DOCUMENTS]


def bucket_coverage(
    per_document: dict[str, Coverage], bucket_ids: Sequence[int], bucket_count: int
) -> dict[int, BucketCoverage]:
    """Each bucket's coverage summed from its documents' (what ``bucket_rows.coverage_of_buckets``
    groups in the database)."""
    out = {b: BucketCoverage() for b in bucket_ids}
    for doc in sorted(per_document):
        cov = per_document[doc]
        b = out.setdefault(bucket_of(doc, bucket_count), BucketCoverage())
        b.chunks += cov.wanted
        b.ready += cov.ready
        b.failed += cov.failed
        b.waiting += cov.waiting
        if cov.failed and len(b.failed_ids) < SAMPLE_IDS:
            b.failed_ids.append(doc)
    return out
