"""What ingest writes, in the transactions it opens: documents upserted, their chunks replaced,
and the queue kept in step (jobs enqueued for new content, revived for content wanted again,
superseded for content nobody wants). Table access: store/documents.py."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import psycopg

from pipeline_assets.content.extract import ExtractorVersions
from pipeline_assets.content.process import KnownDocument, Processed
from pipeline_assets.jobqueue import transitions
from pipeline_assets.store import documents
from pipeline_assets.store.documents import ChunkRow


def known_documents(conn: psycopg.Connection, source_id: int, ids: Sequence[str]) -> dict[str, KnownDocument]:
    """What the database holds about the documents of ``ids`` (those it has), by id."""
    return {row[0]: KnownDocument(*row) for row in documents.existing(conn, source_id, ids)}


def tombstone(conn: psycopg.Connection, doc_pks: Sequence[int]) -> int:
    """Drop the chunks of documents just marked deleted; supersede what nobody wants any more."""
    if not doc_pks:
        return 0
    dropped = documents.delete_chunks(conn, doc_pks)
    return transitions.supersede_unwanted(conn, list(dropped)) if dropped else 0


def write_documents(
    conn: psycopg.Connection,
    source_id: int,
    todo: list[Processed],
    *,
    extractor_version: ExtractorVersions,
    chunker_version: str,
    max_attempts: int,
    config_hash: str,
    dagster_run_id: str | None,
    seen: Sequence[str] | None = None,
) -> dict[str, int]:
    """One ingest batch inside the caller's transaction: the ids ``seen`` recorded (a complete scan's),
    the ingest write lock taken (``documents.write_lock``), the documents upserted with their stage
    rows, their chunks replaced, jobs enqueued, revived and superseded. Four round trips whatever
    the batch holds (the first three statements pipelined, a COPY, the jobs' statement), two more
    when content was dropped. Returns counts (chunks, enqueued, revived, superseded)."""
    columns: dict[str, list] = {
        "exts": [extractor_version.of(p.item.document_id) for p in todo],
        "ids": [p.item.document_id for p in todo],
        "uris": [p.item.source_uri for p in todo],
        "checksums": [p.checksum for p in todo],
        "sizes": [p.item.size for p in todo],
        "tokens": [p.item.token for p in todo],
        "text_checksums": [p.text_checksum for p in todo],
        "counts": [len(p.chunks) for p in todo],
        "classes": [p.error_class for p in todo],
        "messages": [p.error_message for p in todo],
    }
    with conn.pipeline():
        if seen:
            documents.record_seen(conn, seen)
        documents.write_lock(conn)
        pk_of, old_checksums = documents.write_documents(
            conn, source_id, chunker_version, config_hash, dagster_run_id, columns
        )
    new_checksums: set[bytes] = set()
    counts = {"chunks": 0, "enqueued": 0, "revived": 0, "superseded": 0}

    def chunk_rows() -> Iterator[ChunkRow]:
        for p in todo:
            pk = pk_of[p.item.document_id]
            for c in p.chunks:
                digest = bytes.fromhex(c.checksum)
                new_checksums.add(digest)
                counts["chunks"] += 1
                yield pk, c.index, digest, c.text, c.token_count, c.char_start, c.char_end

    documents.copy_chunks(conn, chunk_rows())
    counts["enqueued"], counts["revived"] = transitions.enqueue_chunks(conn, list(new_checksums), max_attempts)
    dropped = old_checksums - new_checksums
    if dropped:
        counts["superseded"] = transitions.supersede_unwanted(conn, list(dropped))
    return counts
