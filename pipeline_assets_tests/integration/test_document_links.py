"""A source's documents, a document's chunks and stage rows (sql/046): written without a per-row
check, deleted together, and a source that still has documents is never deleted."""

from __future__ import annotations

import uuid

import psycopg
import pytest


def _document(conn) -> tuple[int, int]:
    """A source and a document with two chunks and its extract and chunk stage rows: (source, doc_pk)."""
    src = conn.execute(
        "INSERT INTO app.sources (root) VALUES (%s) RETURNING source_id", (f"/links/{uuid.uuid4().hex}",)
    ).fetchone()[0]
    pk = conn.execute(
        """INSERT INTO app.documents (source_id, document_id, source_uri, status, chunk_count)
           VALUES (%s, 'd', 'file:///d', 'current', 2) RETURNING doc_pk""",
        (src,),
    ).fetchone()[0]
    conn.execute(
        """INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)
           SELECT %s, i, sha256((%s || ':' || i)::bytea), 't', 1, 0, 1 FROM generate_series(0, 1) i""",
        (pk, pk),
    )
    conn.execute(
        """INSERT INTO app.stage_runs (doc_pk, stage, status)
           VALUES (%s, 'extract', 'succeeded'), (%s, 'chunk', 'succeeded')""",
        (pk, pk),
    )
    return src, pk


def _rows_of(conn, pk: int) -> tuple[int, int]:
    return conn.execute(
        "SELECT (SELECT count(*) FROM app.chunks WHERE doc_pk = %s), (SELECT count(*) FROM app.stage_runs"
        " WHERE doc_pk = %s)",
        (pk, pk),
    ).fetchone()


def _triggers_fired(conn, statement: str, params: tuple) -> list[tuple[str, int]]:
    """The triggers a statement fired, with their calls (the statement rolled back)."""
    with conn.transaction(force_rollback=True):
        plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params).fetchone()[0][0]
    return [(t["Trigger Name"], t["Calls"]) for t in plan.get("Triggers", [])]


def test_writing_documents_chunks_and_stage_rows_fires_no_per_row_check(clean_db):
    conn = clean_db
    src, pk = _document(conn)
    assert (
        _triggers_fired(
            conn,
            """INSERT INTO app.documents (source_id, document_id, source_uri, status)
           SELECT %s, 'n' || g, 'n', 'current' FROM generate_series(1, 50) g""",
            (src,),
        )
        == []
    )
    assert (
        _triggers_fired(
            conn,
            """INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)
           SELECT %s, 10 + g, sha256(('n' || g)::bytea), 't', 1, 0, 1 FROM generate_series(1, 50) g""",
            (pk,),
        )
        == []
    )
    assert (
        _triggers_fired(
            conn,
            "INSERT INTO app.stage_runs (doc_pk, stage, model_id, status) SELECT %s, 'embed', 'm' || g, 'pending'"
            " FROM generate_series(1, 50) g",
            (pk,),
        )
        == []
    )


def test_a_deleted_document_takes_its_chunks_and_stage_rows_along(clean_db):
    conn = clean_db
    _, kept = _document(conn)
    _, gone = _document(conn)
    assert conn.execute("DELETE FROM app.documents WHERE doc_pk = %s", (gone,)).rowcount == 1
    assert _rows_of(conn, gone) == (0, 0)
    assert _rows_of(conn, kept) == (2, 2)
    conn.execute("TRUNCATE app.documents CASCADE")
    assert conn.execute(
        "SELECT (SELECT count(*) FROM app.chunks), (SELECT count(*) FROM app.stage_runs)"
    ).fetchone() == (
        0,
        0,
    )


def test_a_source_with_documents_is_never_deleted(clean_db):
    conn = clean_db
    src, pk = _document(conn)
    empty = conn.execute("INSERT INTO app.sources (root) VALUES ('/links/empty') RETURNING source_id").fetchone()[0]
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        conn.execute("DELETE FROM app.sources WHERE source_id = %s", (src,))
    with pytest.raises((psycopg.errors.ForeignKeyViolation, psycopg.errors.FeatureNotSupported)):
        conn.execute("TRUNCATE app.sources")
    assert conn.execute("DELETE FROM app.sources WHERE source_id = %s", (empty,)).rowcount == 1
    assert _rows_of(conn, pk) == (2, 2)
