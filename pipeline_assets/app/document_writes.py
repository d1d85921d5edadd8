"""What ingest writes, in the transactions it opens: documents upserted, their chunks replaced,
and the queue kept in step (jobs enqueued for new content, revived for content wanted again,
superseded for content nobody wants). Table access: store/documents.py."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import psycopg

from pipeline_assets.content.extract import ExtractorVersions
from pipeline_assets.content.process import KnownDocument, Processed
from pipeline_assets.jobs import transitions
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
) -> dict[str, int]:
    """Upsert the documents, replace their chunks, enqueue and supersede; one call per
    ingest batch, inside its transaction. Returns counts (chunks, enqueued, revived, superseded)."""
    pk_of = documents.upsert_documents(
        conn,
        source_id,
        chunker_version,
        {
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
        },
    )
    pks = list(pk_of.values())
    old_checksums = documents.delete_chunks(conn, pks)
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
    counts["enqueued"] = transitions.enqueue_for_docs(conn, pks, max_attempts)
    if new_checksums:
        counts["revived"] = transitions.revive_wanted(conn, list(new_checksums))
    dropped = old_checksums - new_checksums
    if dropped:
        counts["superseded"] = transitions.supersede_unwanted(conn, list(dropped))
    documents.record_stage_runs(
        conn,
        config_hash,
        dagster_run_id,
        _stage_run_columns(todo, pk_of, extractor_version=extractor_version, chunker_version=chunker_version),
    )
    return counts


def _stage_run_columns(
    todo: list[Processed], pk_of: dict[str, int], *, extractor_version: ExtractorVersions, chunker_version: str
) -> dict[str, list]:
    """The extract and chunk rows of the documents written, as ``record_stage_runs`` columns."""
    cols: dict[str, list] = {
        k: [] for k in ("pks", "stages", "statuses", "classes", "messages", "versions", "checksums")
    }
    for p in todo:
        extract_failed = p.error_class is not None
        for stage, version in (("extract", extractor_version.of(p.item.document_id)), ("chunk", chunker_version)):
            if stage == "extract" and extract_failed:
                status, cls, msg = "failed", p.error_class, p.error_message
            elif extract_failed:
                status, cls, msg = "skipped", None, None
            else:
                status, cls, msg = "succeeded", None, None
            for key, value in (
                ("pks", pk_of[p.item.document_id]),
                ("stages", stage),
                ("statuses", status),
                ("classes", cls),
                ("messages", msg),
                ("versions", version),
                ("checksums", p.checksum),
            ):
                cols[key].append(value)
    return cols
