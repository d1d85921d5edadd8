"""A table as the Dagster code location's source: the source sensor requests bucket runs for the rows
that changed (observing tokens only), the runs ingest and embed exactly those rows, and
``refresh_documents`` takes ``table:`` ids. Evaluated as the daemon would, runs in-process."""

from __future__ import annotations

import os

import dagster as dg
import pytest

from pipeline_assets.app.table_source import TableSource
from pipeline_assets.defs.ingest.source_sensor import source_documents_sensor
from pipeline_assets_tests.dagster_helpers import bucket_of, evaluate_sensor, execute, fresh_defs
from pipeline_assets_tests.processes import cli

SOURCE = "table:src.pages?id=id&text=body"


def _text(i: int, v: int = 0) -> str:
    return f"page {i} revision {v}: " + " ".join(f"p{(i * 11 + j + v) % 701}" for j in range(20))


@pytest.fixture
def pages(env, clean_db, monkeypatch):
    c = clean_db
    c.execute("TRUNCATE app.table_rows, app.table_marks, app.table_observed, app.source_observations")
    c.execute("DROP SCHEMA IF EXISTS src CASCADE")
    c.execute("DROP SCHEMA IF EXISTS pipeline_changes CASCADE")
    c.execute("CREATE SCHEMA src")
    c.execute("CREATE TABLE src.pages (id int PRIMARY KEY, body text)")
    with c.cursor() as cur:
        cur.executemany("INSERT INTO src.pages VALUES (%s, %s)", [(i, _text(i)) for i in range(1, 4)])
    monkeypatch.setenv("PIPELINE_SOURCE", SOURCE)
    return c


def _docs(conn) -> dict[str, str]:
    return dict(conn.execute("SELECT document_id, status FROM app.documents ORDER BY 1").fetchall())


def _chunk_text(conn, doc: str) -> str:
    return conn.execute(
        "SELECT coalesce(string_agg(c.text, ' '), '') FROM app.chunks c JOIN app.documents d"
        " USING (doc_pk) WHERE d.document_id = %s",
        (doc,),
    ).fetchone()[0]


def test_the_source_sensor_and_bucket_runs_follow_a_table(pages, fake, instance, monkeypatch):
    c = pages
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)
    (request,) = tick.run_requests
    assert execute(defs, instance, request).success
    assert _docs(c) == {f"table:src.pages/{i}": "current" for i in range(1, 4)}
    billed = fake.stats["billed_inputs"]
    assert billed == 3

    # Unchanged: no run, and the table is not listed (its digest is the one observed).
    def listed(self):
        raise AssertionError("the table was listed")

    with monkeypatch.context() as patched:
        patched.setattr(TableSource, "items", listed)
        again = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert not again.run_requests
    # An edited row: one run, of its bucket; only its new text is billed.
    c.execute("UPDATE src.pages SET body = %s WHERE id = 2", (_text(2, 1),))
    tick = evaluate_sensor(source_documents_sensor, defs, instance, again.cursor)
    (request,) = tick.run_requests
    assert request.partition_key == bucket_of("table:src.pages/2")
    assert execute(defs, instance, request).success
    assert "revision 1" in _chunk_text(c, "table:src.pages/2")
    assert fake.stats["billed_inputs"] == billed + 1
    # A deleted row: its run tombstones it.
    c.execute("DELETE FROM src.pages WHERE id = 3")
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    (request,) = tick.run_requests
    assert execute(defs, instance, request).success
    assert _docs(c)["table:src.pages/3"] == "deleted"
    # The table unreadable (dropped): the tick fails, nothing is deleted.
    c.execute("ALTER TABLE src.pages RENAME TO pages_moved")
    with pytest.raises(Exception, match="no such table"):
        evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    c.execute("ALTER TABLE src.pages_moved RENAME TO pages")
    assert _docs(c)["table:src.pages/1"] == "current"


def test_refresh_documents_takes_table_ids(pages, fake):
    c = pages
    defs = fresh_defs()
    job = defs.resolve_job_def("refresh_documents")
    instance = dg.DagsterInstance.ephemeral()
    result = job.execute_in_process(
        instance=instance,
        run_config={"ops": {"refresh_documents_op": {"config": {"document_ids": ["table:src.pages/1"]}}}},
    )
    assert result.success
    assert _docs(c) == {"table:src.pages/1": "current"}
    assert fake.stats["billed_inputs"] == 1
    c.execute("DELETE FROM src.pages WHERE id = 1")
    result = job.execute_in_process(
        instance=instance,
        run_config={"ops": {"refresh_documents_op": {"config": {"document_ids": ["table:src.pages/1"]}}}},
    )
    assert result.success and _docs(c) == {"table:src.pages/1": "deleted"}


def test_with_the_change_log_a_tick_reads_only_the_logged_rows(pages, fake, instance, monkeypatch):
    c = pages
    assert "installed" in cli("source", "install-triggers", SOURCE, env=dict(os.environ)).stdout
    defs = fresh_defs()
    tick = evaluate_sensor(source_documents_sensor, defs, instance)  # the first tick lists the table
    (request,) = tick.run_requests
    assert execute(defs, instance, request).success
    billed = fake.stats["billed_inputs"]

    def listed(self):
        raise AssertionError("the table was listed")

    monkeypatch.setattr(TableSource, "items", listed)  # from here on, a complete listing fails the test
    c.execute("UPDATE src.pages SET body = %s WHERE id = 1", (_text(1, 7),))
    c.execute("DELETE FROM src.pages WHERE id = 2")
    c.execute("INSERT INTO src.pages VALUES (9, %s)", (_text(9),))
    tick = evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor)
    assert c.execute("SELECT count(*) FROM pipeline_changes.log").fetchone()[0] == 0  # consumed by the tick
    for request in tick.run_requests:
        assert execute(defs, instance, request).success
    docs = _docs(c)
    assert (docs["table:src.pages/1"], docs["table:src.pages/2"], docs["table:src.pages/9"]) == (
        "current",
        "deleted",
        "current",
    )
    assert "revision 7" in _chunk_text(c, "table:src.pages/1")
    assert fake.stats["billed_inputs"] == billed + 2
    assert not evaluate_sensor(source_documents_sensor, defs, instance, tick.cursor).run_requests
    c.execute("DROP SCHEMA pipeline_changes CASCADE")
