"""`embed "table:..."`, `ingest`, `reconcile` and `source install-triggers` from the command line,
with the fake provider: what is billed, what a rerun sends, one-line errors; and a table in a
second database of the same server (PIPELINE_SOURCE_DATABASE_URL)."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from pipeline_assets_tests.conftest import _with_dbname
from pipeline_assets_tests.processes import cli, kill_group, start_cli, wait_for_line

SOURCE = "table:src.notes?id=id&text=body&updated=updated_at"


def _text(i: int, v: int = 0) -> str:
    return f"note {i} version {v}: " + " ".join(f"t{(i * 17 + j + v) % 883}" for j in range(25))


def _create(conn, rows: int = 12) -> None:
    conn.execute("DROP SCHEMA IF EXISTS src CASCADE")
    conn.execute("DROP SCHEMA IF EXISTS pipeline_changes CASCADE")
    conn.execute("CREATE SCHEMA src")
    conn.execute(
        "CREATE TABLE src.notes (id bigint PRIMARY KEY, body text,"
        " updated_at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )
    with conn.cursor() as cur:
        cur.executemany("INSERT INTO src.notes (id, body) VALUES (%s, %s)", [(i, _text(i)) for i in range(rows)])


@pytest.fixture
def notes(clean_db):
    clean_db.execute("TRUNCATE app.table_rows, app.table_marks, app.table_observed")
    _create(clean_db)
    return clean_db


def _embed(env, source: str = SOURCE) -> dict:
    return json.loads(cli("embed", source, "--json", env=env).stdout)


def test_embed_a_table_then_a_rerun_sends_nothing(env, notes, fake):
    first = _embed(env)
    assert first["documents_changed"] == 12 and first["embedded"] >= 12
    billed = fake.stats["billed_inputs"]
    assert (
        notes.execute(
            "SELECT count(*) FROM app.documents WHERE document_id LIKE 'table:src.notes/%%' AND status = 'current'"
        ).fetchone()[0]
        == 12
    )
    again = _embed(env)
    assert (again["documents"], again["documents_changed"], again["provider_calls"]) == (0, 0, 0)
    assert fake.stats["billed_inputs"] == billed
    # An edit, a delete, an insert: exactly the new text is billed.
    notes.execute("UPDATE src.notes SET body = %s, updated_at = clock_timestamp() WHERE id = 3", (_text(3, 9),))
    notes.execute("DELETE FROM src.notes WHERE id = 4")
    notes.execute("INSERT INTO src.notes (id, body) VALUES (40, %s)", (_text(40),))
    changed = _embed(env)
    assert (changed["documents_changed"], changed["deleted"]) == (2, 1)
    assert fake.stats["billed_inputs"] == billed + 2
    assert fake.billed_count(_text(40)) == 1


def test_errors_are_one_line(env, notes):
    for source, expected in [
        ("table:src.notes?id=id&text=content", "error: table source src.notes: no column content"),
        ("table:src.gone?id=id&text=body", "error: table source src.gone: no such table or view"),
        ("table:src.notes?id=id&text=body;drop", "is not a column name"),
    ]:
        proc = cli("ingest", source, env=env, check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_install_triggers_without_the_privilege_is_one_line(env, notes, database_url):
    role = "notes_reader"
    notes.execute(f"DROP ROLE IF EXISTS {role}")
    notes.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'never-shown-pw'")
    notes.execute(f"GRANT USAGE ON SCHEMA src TO {role}")
    notes.execute(f"GRANT SELECT ON src.notes TO {role}")
    try:
        url = psycopg.conninfo.make_conninfo(database_url, user=role, password="never-shown-pw")
        proc = cli("source", "install-triggers", SOURCE, env={**env, "PIPELINE_SOURCE_DATABASE_URL": url}, check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "cannot install the change log" in proc.stderr and "TRIGGER" in proc.stderr
        assert "never-shown-pw" not in proc.stderr + proc.stdout
    finally:
        notes.execute(f"REVOKE ALL ON src.notes FROM {role}")
        notes.execute(f"REVOKE ALL ON SCHEMA src FROM {role}")
        notes.execute(f"DROP OWNED BY {role}")
        notes.execute(f"DROP ROLE {role}")


def test_a_table_in_another_database_followed_through_the_change_log(env, clean_db, server_url, fake):
    """PIPELINE_SOURCE_DATABASE_URL names another database of the same server; the change log is
    installed there; inserts, updates, deletes and a TRUNCATE reach the job table without a scan."""
    clean_db.execute("TRUNCATE app.table_rows, app.table_marks, app.table_observed")
    name = "t_source_" + uuid.uuid4().hex[:8]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        url = _with_dbname(server_url, name)
        with psycopg.connect(url, autocommit=True) as src:
            _create(src)
            env2 = {**env, "PIPELINE_SOURCE_DATABASE_URL": url}
            assert "change log installed" in cli("source", "install-triggers", SOURCE, env=env2).stdout
            assert _embed(env2)["documents_changed"] == 12  # the first scan of a table is a full one
            src.execute("INSERT INTO src.notes (id, body) VALUES (12, %s)", (_text(12),))
            assert src.execute("SELECT count(*) FROM pipeline_changes.log").fetchone()[0] == 1
            report = json.loads(cli("ingest", SOURCE, "--json", env=env2).stdout)
            assert (report["new"], report["scanned"]) == (1, 1)
            assert src.execute("SELECT count(*) FROM pipeline_changes.log").fetchone()[0] == 0  # consumed
            src.execute("UPDATE src.notes SET body = %s WHERE id = 5", (_text(5, 1),))  # updated_at untouched
            src.execute("DELETE FROM src.notes WHERE id = 6")
            report = json.loads(cli("ingest", SOURCE, "--json", env=env2).stdout)
            assert (report["changed"], report["deleted"], report["scanned"]) == (1, 1, 1)
            # reconcile compares the checksums and leaves the change log to `ingest`.
            src.execute("UPDATE src.notes SET body = %s WHERE id = 7", (_text(7, 1),))
            assert json.loads(cli("reconcile", "--json", env=env2).stdout)["changed"] == 1
            assert src.execute("SELECT count(*) FROM pipeline_changes.log").fetchone()[0] == 1
            report = json.loads(cli("ingest", SOURCE, "--json", env=env2).stdout)
            assert (report["scanned"], report["unchanged"], report["changed"]) == (1, 1, 0)
            src.execute("TRUNCATE src.notes")
            refused = cli("ingest", SOURCE, env=env2, check=False)
            assert refused.returncode == 1 and "is empty but 12 of its rows were ingested" in refused.stderr
            report = json.loads(cli("ingest", SOURCE, "--allow-empty", "--json", env=env2).stdout)
            assert report["deleted"] == 12
            assert clean_db.execute("SELECT count(*) FROM app.documents WHERE status = 'current'").fetchone()[0] == 0
            assert "change log removed" in cli("source", "uninstall-triggers", SOURCE, env=env2).stdout
            assert (
                src.execute("SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'pipeline_changes%%'").fetchone()[0] == 0
            )
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_crash_before_the_log_is_consumed_re_reads_it(env, notes):
    """SIGKILL after the logged rows' documents were committed, before their entries were
    deleted: the entries are still there, and the next ingest reads them again (and writes nothing)."""
    assert "installed" in cli("source", "install-triggers", SOURCE, env=env).stdout
    assert json.loads(cli("ingest", SOURCE, "--json", env=env).stdout)["new"] == 12
    notes.execute("UPDATE src.notes SET body = %s WHERE id = 2", (_text(2, 4),))
    notes.execute("DELETE FROM src.notes WHERE id = 3")
    proc = start_cli("ingest", SOURCE, env={**env, "PIPELINE_CRASHPOINT": "log_unconsumed"})
    try:
        wait_for_line(proc, "CRASHPOINT log_unconsumed")
    finally:
        kill_group(proc)
    docs = dict(notes.execute("SELECT document_id, status FROM app.documents").fetchall())
    assert (docs["table:src.notes/2"], docs["table:src.notes/3"]) == ("current", "deleted")  # committed
    assert notes.execute("SELECT count(*) FROM pipeline_changes.log").fetchone()[0] == 2  # not consumed
    report = json.loads(cli("ingest", SOURCE, "--json", env=env).stdout)
    assert (report["scanned"], report["unchanged"], report["changed"], report["deleted"]) == (1, 1, 0, 0)
    assert notes.execute("SELECT count(*) FROM pipeline_changes.log").fetchone()[0] == 0
    notes.execute("DROP SCHEMA pipeline_changes CASCADE")


def test_wrong_credentials_or_no_server_is_one_line_and_tombstones_nothing(env, notes, database_url):
    assert json.loads(cli("ingest", SOURCE, "--json", env=env).stdout)["new"] == 12
    wrong = psycopg.conninfo.make_conninfo(database_url, user="nobody_here", password="expired-secret-pw")
    gone = psycopg.conninfo.make_conninfo(database_url, host="127.0.0.1", port="1", password="expired-secret-pw")
    for url in (wrong, gone):
        proc = cli("ingest", SOURCE, env={**env, "PIPELINE_SOURCE_DATABASE_URL": url}, check=False)
        assert proc.returncode == 1 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert "expired-secret-pw" not in proc.stderr + proc.stdout
    assert notes.execute("SELECT count(*) FROM app.documents WHERE status = 'current'").fetchone()[0] == 12
    notes.execute("DELETE FROM src.notes WHERE id = 0")
    assert json.loads(cli("ingest", SOURCE, "--json", env=env).stdout)["deleted"] == 1  # converges
