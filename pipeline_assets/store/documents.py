"""The document table family (SQL: ``sql/queries/documents.sql``): sources, documents, chunks
and their extract/chunk stage rows, read and written in the transactions ingest opens."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg.rows import class_row

from pipeline_assets.store import queries

DOCS = queries.load("documents")

# Arbitrary fixed key: one content-changing ingest transaction at a time.
INGEST_WRITE_LOCK_KEY = 7_301_946_222

# A chunk row as ``copy_chunks`` writes it: (doc_pk, index, checksum, text, tokens, char start, char end).
ChunkRow = tuple[int, int, bytes, str, int, int, int]


class SourceRef(Protocol):
    """What registering a source needs of it."""

    @property
    def key(self) -> str: ...

    @property
    def kind(self) -> str: ...


@dataclass(frozen=True)
class TouchedDocument:
    document_id: str
    status: str  # current, quarantined, deleted (tombstoned)
    new: bool  # first seen since ``since``


def write_lock(conn: psycopg.Connection) -> None:
    """Serialise transactions that replace chunks. Two concurrent ingests that
    share a chunk checksum could otherwise each miss the other's chunk row and
    supersede (and delete the vector of) content that is still wanted. The
    transactions are short; workers never take this lock."""
    conn.execute(DOCS.write_lock, {"key": INGEST_WRITE_LOCK_KEY})


def has_documents(conn: psycopg.Connection, source_id: int) -> bool:
    """Whether the source has any document row, whatever its status."""
    return bool(queries.scalar(conn, DOCS.has_documents, {"source": source_id}))


def register_source(conn: psycopg.Connection, source: SourceRef) -> int:
    """The source's row (its key and kind), created on first use."""
    return queries.scalar(conn, DOCS.register_source, {"root": source.key, "kind": source.kind})


def source_roots(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute(DOCS.sources)]


def existing(conn: psycopg.Connection, source_id: int, ids: Sequence[str]) -> list[tuple[Any, ...]]:
    """(document_id, source_checksum, extractor_version, chunker_version, status, error_class,
    size_bytes, source_token) of the documents of ``ids`` the source holds."""
    return conn.execute(DOCS.existing, {"source": source_id, "ids": list(ids)}).fetchall()


def delete_chunks(conn: psycopg.Connection, doc_pks: Sequence[int]) -> set[bytes]:
    """Delete the chunks of some documents; the checksums they held."""
    return {r[0] for r in conn.execute(DOCS.delete_chunks, {"pks": list(doc_pks)})}


def tombstone_unseen(conn: psycopg.Connection, source_id: int, scan_started: datetime) -> list[int]:
    """Mark deleted what a complete scan (``ingest_seen``) did not list; return their keys."""
    return [r[0] for r in conn.execute(DOCS.tombstone_unseen, {"source": source_id, "scan_started": scan_started})]


def tombstone_ids(conn: psycopg.Connection, source_id: int, ids: Sequence[str]) -> list[int]:
    return [r[0] for r in conn.execute(DOCS.tombstone_ids, {"source": source_id, "ids": list(ids)})]


def start_scan(conn: psycopg.Connection) -> datetime:
    """Prepare the list of seen ids for a complete scan; return the database clock."""
    started = queries.scalar(conn, DOCS.db_now)
    conn.execute(DOCS.create_seen)
    conn.execute(DOCS.truncate_seen)
    return started


def record_seen(conn: psycopg.Connection, ids: Sequence[str]) -> None:
    """Add ids to this session's list of those a complete scan has seen (``start_scan``)."""
    conn.execute(DOCS.insert_seen, {"ids": list(ids)})


def current_count(conn: psycopg.Connection, source_id: int) -> int:
    return queries.scalar(conn, DOCS.current_count, {"source": source_id})


def mark_scanned(conn: psycopg.Connection, source_id: int) -> None:
    conn.execute(DOCS.mark_scanned, {"source": source_id})


def write_documents(
    conn: psycopg.Connection,
    source_id: int,
    chunker_version: str,
    config_hash: str,
    dagster_run_id: str | None,
    columns: dict[str, list],
) -> tuple[dict[str, int], set[bytes]]:
    """Upsert one row per document from ``columns`` (ids, uris, checksums, sizes, tokens, exts,
    text_checksums, counts, classes, messages: one entry each per document), delete their chunks and
    write their extract and chunk stage rows, in one statement. Returns ({document_id: doc_pk}, the
    checksums of the chunks deleted)."""
    params = {"source": source_id, "chunker": chunker_version, "config": config_hash, "run": dagster_run_id}
    pk_of: dict[str, int] = {}
    dropped: set[bytes] = set()
    for document_id, doc_pk, checksum in conn.execute(DOCS.write_documents, {**params, **columns}).fetchall():
        if document_id is None:
            dropped.add(checksum)
        else:
            pk_of[document_id] = doc_pk
    return pk_of, dropped


# The column types of ``copy_chunks`` (a binary COPY), in ``ChunkRow``'s order.
CHUNK_COPY_TYPES = ["int8", "int4", "bytea", "text", "int4", "int4", "int4"]


def copy_chunks(conn: psycopg.Connection, rows: Iterable[ChunkRow]) -> None:
    """Write chunk rows (their documents' old chunks already deleted)."""
    with conn.cursor().copy(DOCS.copy_chunks) as copy:
        copy.set_types(CHUNK_COPY_TYPES)
        for row in rows:
            copy.write_row(row)


def touched_since(conn: psycopg.Connection, root: str, since: datetime) -> list[TouchedDocument]:
    """Documents of the source ``root`` (as registered) whose row changed since ``since`` (database
    clock): what the Dagster layer reports after a reconciliation."""
    with conn.cursor(row_factory=class_row(TouchedDocument)) as cur:
        return cur.execute(DOCS.touched_since, {"root": root, "since": since}).fetchall()
