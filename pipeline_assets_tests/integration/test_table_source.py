"""A PostgreSQL table as a source: the source string, the three ways changes are found
(full checksum check, watermark, trigger change log), skips, quarantines, and the
failures that must never tombstone anything. The source table lives in a schema of
the module's test database (one test: in a second database of the same server)."""

from __future__ import annotations

import psycopg
import pytest

from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.runtime import IngestOptions
from pipeline_assets.app.table_ingest import CHANGE_LOG, FULL, WATERMARK, scan_table
from pipeline_assets.app.table_source import TableSource
from pipeline_assets.content.chunking import Chunker
from pipeline_assets.content.source import SourceError
from pipeline_assets.settings import Settings
from pipeline_assets.store import change_log, db
from pipeline_assets.store.table_source import (
    TableSourceError,
    TableSpec,
    open_table,
    parse_table_source,
)

SOURCE = "table:src.docs?id=id&text=body&updated=updated_at"


def _options(allow_empty: bool = False, max_bytes: int = 1 << 20) -> IngestOptions:
    return IngestOptions(
        chunker=Chunker(max_tokens=32, overlap=4), config=IngestConfig(max_bytes=max_bytes), allow_empty=allow_empty
    )


def _text(i: int, v: int = 0) -> str:
    return f"row {i} version {v}: " + " ".join(f"w{(i * 13 + j + v) % 991}" for j in range(30))


@pytest.fixture
def source(clean_db):
    """src.docs with rows 1..20 and a clean change log; the project database is the source's."""
    c = clean_db
    c.execute("TRUNCATE app.table_rows, app.table_marks, app.table_observed")
    c.execute("DROP SCHEMA IF EXISTS src CASCADE")
    c.execute("DROP SCHEMA IF EXISTS pipeline_changes CASCADE")
    c.execute("CREATE SCHEMA src")
    c.execute("CREATE TABLE src.docs (id int PRIMARY KEY, body text, updated_at timestamptz NOT NULL DEFAULT now())")
    with c.cursor() as cur:
        cur.executemany("INSERT INTO src.docs (id, body) VALUES (%s, %s)", [(i, _text(i)) for i in range(1, 21)])
    return c


def _source(url: str, spec: str = SOURCE) -> TableSource:
    return TableSource(spec, Settings.from_env({"PIPELINE_DATABASE_URL": url}).source_config())


@pytest.fixture
def table(database_url, source):
    src = _source(database_url)
    yield src
    src.close()


def _docs(conn) -> dict[str, str]:
    return dict(
        conn.execute(
            "SELECT document_id, status || coalesce(':' || error_class, '') FROM app.documents"
            " WHERE document_id LIKE 'table:%'"
        ).fetchall()
    )


def _current_text(conn, doc_id: str) -> str:
    return " ".join(
        r[0]
        for r in conn.execute(
            "SELECT c.text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = %s"
            " ORDER BY c.chunk_index",
            (doc_id,),
        )
    )


# -- the source string -------------------------------------------------------------------------
def test_the_source_string_names_identifiers_only():
    spec = parse_table_source("table:app_data.Notes?id=note_id&text=body&updated=changed_at")
    assert spec == TableSpec("app_data", "Notes", "note_id", "body", "changed_at")
    assert spec.document_id("42") == "table:app_data.Notes/42"
    assert spec.row_id("table:app_data.Notes/42") == "42" and spec.row_id("table:other.t/42") is None
    assert parse_table_source(spec.uri) == spec
    assert parse_table_source("table:docs?id=id&text=t").schema == "public"
    for bad, why in [
        ("table:s.t?id=id", "missing text"),
        ("table:s.t?id=id&text=body;drop table x", "not a column name"),
        ("table:s.t?id=id&text=lower(body)", "not a column name"),
        ("table:s.t?id=id&text=a&text=b", "given twice"),
        ("table:s.t?id=id&text=a&where=x", "unknown option"),
        ("table:s.t where 1=1?id=id&text=a", "identifiers only"),
        ("table:a.b.c?id=id&text=a", "identifiers only"),
    ]:
        with pytest.raises(TableSourceError, match=why):
            parse_table_source(bad)


def test_missing_table_column_or_grant_is_one_line(database_url, source):
    with db.connect(database_url) as src:
        for text, expected in [
            ("table:src.nope?id=id&text=body", "src.nope: no such table or view"),
            ("table:src.docs?id=id&text=content", "src.docs: no column content"),
            ("table:src.docs?id=id&text=body&updated=ts", "src.docs: no column ts"),
        ]:
            with pytest.raises(TableSourceError) as e:
                open_table(src, parse_table_source(text))
            assert str(e.value).endswith(expected) and "\n" not in str(e.value)


# -- following changes ---------------------------------------------------------------------------
def _edit_delete_insert(c) -> None:
    c.execute("UPDATE src.docs SET body = %s, updated_at = now() WHERE id = 3", (_text(3, 1),))
    c.execute("DELETE FROM src.docs WHERE id IN (4, 5)")
    c.execute("INSERT INTO src.docs (id, body) VALUES (21, %s)", (_text(21),))


@pytest.mark.parametrize("way", [FULL, WATERMARK, CHANGE_LOG])
def test_edits_deletes_inserts_and_truncate_are_followed(source, table, way):
    c = source
    if way == CHANGE_LOG:
        change_log.install(table.table)
    first, scan = scan_table(c, table, _options(), way=way if way != CHANGE_LOG else FULL)
    assert first.new == 20 and set(_docs(c).values()) == {"current"}
    if way == CHANGE_LOG:  # the first full ingest saw every row; the entries of the inserts re-read nothing new
        _, scan = scan_table(c, table, _options(), way=way)
        assert scan.rows_listed == 0

    _edit_delete_insert(c)
    report, scan = scan_table(c, table, _options(), way=way)
    assert (report.new, report.changed, report.deleted) == (1, 1, 2)
    docs = _docs(c)
    assert docs["table:src.docs/4"] == docs["table:src.docs/5"] == "deleted"
    assert docs["table:src.docs/21"] == "current"
    assert "version 1" in _current_text(c, "table:src.docs/3")
    assert scan.rows_read <= 2 + (2 if way == CHANGE_LOG else 0)  # only the changed rows' text was read
    if way == CHANGE_LOG:
        assert scan.rows_listed == 0 and change_log.pending(table.table) == 0  # no scan; the log consumed

    c.execute("TRUNCATE src.docs")
    with pytest.raises(TableSourceError, match="is empty but 19 of its rows were ingested"):
        scan_table(c, table, _options(), way=way)  # as an empty folder: refused unless meant
    assert set(_docs(c).values()) == {"current", "deleted"}
    report, _ = scan_table(c, table, _options(allow_empty=True), way=way)
    assert report.deleted == 19
    assert set(_docs(c).values()) == {"deleted"}
    assert c.execute("SELECT count(*) FROM app.chunks").fetchone()[0] == 0


def test_an_unchanged_table_lists_and_reads_no_row(source, table):
    c = source
    scan_table(c, table, _options(), way=FULL)
    for way in (FULL, WATERMARK):
        report, scan = scan_table(c, table, _options(), way=way)
        assert (report.scanned, scan.rows_read, scan.buckets_listed) == (0, 0, 0), way
        # the watermark lists again only the rows at the mark itself (a later commit of the same value)
        assert scan.rows_listed == (0 if way == FULL else 20), way
    for v, way in ((2, FULL), (3, WATERMARK)):
        c.execute("UPDATE src.docs SET body = %s WHERE id = 7", (_text(7, v),))  # updated_at left alone
        report, scan = scan_table(c, table, _options(), way=way)
        assert report.changed == 1 and scan.rows_read == 1, way  # the one row's text
        assert f"version {v}" in _current_text(c, "table:src.docs/7")
    assert scan.rows_listed < 40  # the rows at the mark, then one bucket's rows


def test_null_and_empty_text_are_counted_skips_and_oversize_is_quarantined(source, table):
    c = source
    c.execute("UPDATE src.docs SET body = NULL WHERE id = 1")
    c.execute("UPDATE src.docs SET body = '' WHERE id = 2")
    c.execute("UPDATE src.docs SET body = repeat('x', 5000) WHERE id = 3")
    report, _ = scan_table(c, table, _options(max_bytes=4096), way=FULL)
    # Not errors of the batch: the other 17 are current; the three are shown with their class.
    assert (report.new, report.quarantined, report.errors) == (20, 3, {"empty_text": 2, "too_large": 1})
    docs = _docs(c)
    assert docs["table:src.docs/1"] == docs["table:src.docs/2"] == "quarantined:empty_text"
    assert docs["table:src.docs/3"] == "quarantined:too_large"
    assert sum(v == "current" for v in docs.values()) == 17
    assert (
        c.execute(
            "SELECT count(*) FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.status <> 'current'"
        ).fetchone()[0]
        == 0
    )
    # Unchanged: nothing read again, the quarantines stand; a text for row 1 makes it a document.
    report, scan = scan_table(c, table, _options(max_bytes=4096), way=FULL)
    assert (report.scanned, scan.rows_read) == (0, 0)
    c.execute("UPDATE src.docs SET body = %s WHERE id = 1", (_text(1, 5),))
    c.execute("UPDATE src.docs SET body = NULL WHERE id = 4")
    report, _ = scan_table(c, table, _options(max_bytes=4096), way=FULL)
    assert (report.changed, report.quarantined, report.errors) == (2, 1, {"empty_text": 1})
    docs = _docs(c)
    assert docs["table:src.docs/1"] == "current" and docs["table:src.docs/4"] == "quarantined:empty_text"


# -- failures never tombstone ------------------------------------------------------------------------
def test_a_locked_table_fails_the_scan_and_tombstones_nothing(database_url, source, table):
    c = source
    table.lock_timeout = "200ms"
    scan_table(c, table, _options(), way=FULL)
    c.execute("DELETE FROM src.docs WHERE id = 9")
    with db.connect(database_url, autocommit=False) as locker:
        locker.execute("LOCK TABLE src.docs IN ACCESS EXCLUSIVE MODE")
        for way in (FULL, WATERMARK):
            with pytest.raises(TableSourceError, match="locked"):
                scan_table(c, table, _options(), way=way)
        with pytest.raises(SourceError, match=r"src\.docs: the table is locked"):
            table.ingest_changes(c, _options())  # what ingest and the sensor see
        locker.rollback()
    assert set(_docs(c).values()) == {"current"}
    report, _ = scan_table(c, table, _options(), way=FULL)  # the next scan converges
    assert report.deleted == 1 and _docs(c)["table:src.docs/9"] == "deleted"


def test_install_triggers_without_the_trigger_privilege_is_one_line(database_url, source):
    c = source
    role = "table_reader_no_trigger"
    c.execute(f"DROP ROLE IF EXISTS {role}")
    c.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw-never-printed'")
    c.execute(f"GRANT USAGE ON SCHEMA src TO {role}")
    c.execute(f"GRANT SELECT ON src.docs TO {role}")
    c.execute(f"GRANT CREATE ON DATABASE {c.info.dbname} TO {role}")
    url = psycopg.conninfo.make_conninfo(database_url, user=role, password="pw-never-printed")
    try:
        with db.connect(url) as src:
            table = open_table(src, parse_table_source(SOURCE))
            with pytest.raises(TableSourceError) as e:
                change_log.install(table)
            message = str(e.value)
            assert "\n" not in message and "TRIGGER" in message and "pw-never-printed" not in message
            assert "must be owner" in message or "permission denied" in message
            assert not change_log.is_installed(table)
    finally:
        c.execute(f"REVOKE ALL ON src.docs FROM {role}")
        c.execute(f"REVOKE ALL ON SCHEMA src FROM {role}")
        c.execute(f"REVOKE ALL ON DATABASE {c.info.dbname} FROM {role}")
        c.execute("DROP SCHEMA IF EXISTS pipeline_changes CASCADE")
        c.execute(f"DROP OWNED BY {role}")
        c.execute(f"DROP ROLE {role}")
