"""Writes of the document table family (sources, documents, chunks and their
extract/chunk stage rows), in the transactions ingest opens. SQL:
``sql/queries/documents.sql``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

import psycopg
from psycopg.rows import class_row

from pipeline_assets.content.extract import ExtractorVersions
from pipeline_assets.content.process import KnownDocument, Processed
from pipeline_assets.content.source import Source
from pipeline_assets.jobs import transitions
from pipeline_assets.store import queries

DOCS = queries.load("documents")

# Arbitrary fixed key: one content-changing ingest transaction at a time.
INGEST_WRITE_LOCK_KEY = 7_301_946_222


def write_lock(conn: psycopg.Connection) -> None:
    """Serialise transactions that replace chunks. Two concurrent ingests that
    share a chunk checksum could otherwise each miss the other's chunk row and
    supersede (and delete the vector of) content that is still wanted. The
    transactions are short; workers never take this lock."""
    conn.execute(DOCS.write_lock, {"key": INGEST_WRITE_LOCK_KEY})


def register_source(conn: psycopg.Connection, source: Source) -> int:
    """The source's row (its key and kind), created on first use."""
    return queries.scalar(conn, DOCS.register_source, {"root": source.key, "kind": source.kind})


def source_roots(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute(DOCS.sources)]


def has_documents(conn: psycopg.Connection, source_id: int) -> bool:
    """Whether the source has any document row, whatever its status."""
    return bool(queries.scalar(conn, DOCS.has_documents, {"source": source_id}))


def known_documents(conn: psycopg.Connection, source_id: int, ids: Sequence[str]) -> dict[str, KnownDocument]:
    with conn.cursor(row_factory=class_row(KnownDocument)) as cur:
        cur.execute(DOCS.existing, {"source": source_id, "ids": list(ids)})
        return {k.document_id: k for k in cur}


def tombstone(conn: psycopg.Connection, doc_pks: Sequence[int]) -> int:
    """Drop the chunks of documents just marked deleted; supersede what nobody wants any more."""
    if not doc_pks:
        return 0
    dropped = {r[0] for r in conn.execute(DOCS.delete_chunks, {"pks": list(doc_pks)})}
    return transitions.supersede_unwanted(conn, list(dropped)) if dropped else 0


def tombstone_unseen(conn: psycopg.Connection, source_id: int, scan_started: datetime) -> list[int]:
    """Mark deleted what a complete scan (``ingest_seen``) did not list; return their keys."""
    return [r[0] for r in conn.execute(DOCS.tombstone_unseen, {"source": source_id,
                                                               "scan_started": scan_started})]


def tombstone_ids(conn: psycopg.Connection, source_id: int, ids: Sequence[str]) -> list[int]:
    return [r[0] for r in conn.execute(DOCS.tombstone_ids, {"source": source_id, "ids": list(ids)})]


def start_scan(conn: psycopg.Connection) -> datetime:
    """Prepare the list of seen ids for a complete scan; return the database clock."""
    started = queries.scalar(conn, DOCS.db_now)
    conn.execute(DOCS.create_seen)
    conn.execute(DOCS.truncate_seen)
    return started


def record_seen(conn: psycopg.Connection, ids: Iterable[str]) -> None:
    with conn.cursor().copy(DOCS.copy_seen) as copy:
        for doc_id in ids:
            copy.write_row((doc_id,))


def current_count(conn: psycopg.Connection, source_id: int) -> int:
    return queries.scalar(conn, DOCS.current_count, {"source": source_id})


def mark_scanned(conn: psycopg.Connection, source_id: int) -> None:
    conn.execute(DOCS.mark_scanned, {"source": source_id})


def write_documents(conn: psycopg.Connection, source_id: int, todo: list[Processed], *,
                    extractor_version: ExtractorVersions,
                    chunker_version: str, max_attempts: int, config_hash: str,
                    run_id: str | None) -> dict[str, int]:
    """Upsert the documents, replace their chunks, enqueue and supersede; one call per
    ingest batch, inside its transaction. Returns counts (chunks, enqueued, revived, superseded)."""
    rows = conn.execute(DOCS.upsert_documents, {
        "source": source_id, "chunker": chunker_version,
        "exts": [extractor_version.of(p.item.document_id) for p in todo],
        "ids": [p.item.document_id for p in todo], "uris": [p.item.source_uri for p in todo],
        "checksums": [p.checksum for p in todo], "sizes": [p.item.size for p in todo],
        "tokens": [p.item.token for p in todo],
        "text_checksums": [p.text_checksum for p in todo], "counts": [len(p.chunks) for p in todo],
        "classes": [p.error_class for p in todo], "messages": [p.error_message for p in todo]}).fetchall()
    pk_of: dict[str, int] = dict(rows)
    pks = list(pk_of.values())
    old_checksums = {r[0] for r in conn.execute(DOCS.delete_chunks, {"pks": pks})}
    new_checksums: set[bytes] = set()
    counts = {"chunks": 0, "enqueued": 0, "revived": 0, "superseded": 0}
    with conn.cursor().copy(DOCS.copy_chunks) as copy:
        for p in todo:
            pk = pk_of[p.item.document_id]
            for c in p.chunks:
                digest = bytes.fromhex(c.checksum)
                new_checksums.add(digest)
                copy.write_row((pk, c.index, digest, c.text, c.token_count, c.char_start, c.char_end))
                counts["chunks"] += 1
    counts["enqueued"] = transitions.enqueue_for_docs(conn, pks, max_attempts)
    if new_checksums:
        counts["revived"] = transitions.revive_wanted(conn, list(new_checksums))
    dropped = old_checksums - new_checksums
    if dropped:
        counts["superseded"] = transitions.supersede_unwanted(conn, list(dropped))
    _record_stage_runs(conn, todo, pk_of, extractor_version=extractor_version, chunker_version=chunker_version,
                       config_hash=config_hash, run_id=run_id)
    return counts


def _record_stage_runs(conn: psycopg.Connection, todo: list[Processed], pk_of: dict[str, int], *,
                       extractor_version: ExtractorVersions, chunker_version: str, config_hash: str,
                       run_id: str | None) -> None:
    cols: dict[str, list] = {k: [] for k in ("pks", "stages", "statuses", "classes", "messages", "versions",
                                             "checksums")}
    for p in todo:
        extract_failed = p.error_class is not None
        for stage, version in (("extract", extractor_version.of(p.item.document_id)),
                               ("chunk", chunker_version)):
            if stage == "extract" and extract_failed:
                status, cls, msg = "failed", p.error_class, p.error_message
            elif extract_failed:
                status, cls, msg = "skipped", None, None
            else:
                status, cls, msg = "succeeded", None, None
            for key, value in (("pks", pk_of[p.item.document_id]), ("stages", stage), ("statuses", status),
                               ("classes", cls), ("messages", msg), ("versions", version),
                               ("checksums", p.checksum)):
                cols[key].append(value)
    conn.execute(DOCS.record_stage_runs, {"config": config_hash, "run": run_id, **cols})
