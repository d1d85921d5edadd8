"""app.stage_runs for embed: one row per document AND model,
refreshed only for the documents a work run touched, and a `status` that writes
nothing (run by a real role that can only SELECT)."""

from __future__ import annotations

import json
import threading
import uuid

import psycopg
import pytest

from pipeline_assets.app import embed, embed_selection
from pipeline_assets.app import status as status_uc
from pipeline_assets.app.ingest import ingest_source, register_model
from pipeline_assets.app.reconcile import reconcile
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.registry import background_build
from pipeline_assets.settings import Settings
from pipeline_assets.store import db, stage_runs
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli, wait_until

SECOND_MODEL = "fake-embed-b"


@pytest.fixture
def pool(env, clean_db, database_url):
    p = db.make_pool(database_url, max_size=4)
    yield p
    p.close()


def runtime(model: str = FAKE_MODEL) -> Runtime:
    return Runtime.build(Settings.from_env(), model)


def embed_rows(conn) -> dict[tuple[str, str], tuple]:
    """(document_id, model) -> (status, error_class, attempts) of every stored embed row."""
    return {
        (doc, model): (st, cls, att)
        for doc, model, st, cls, att in conn.execute(
            """SELECT d.document_id, s.model_id, s.status, s.error_class, s.attempts
           FROM app.stage_runs s JOIN app.documents d USING (doc_pk) WHERE s.stage = 'embed'"""
        )
    }


def fail_job_of(conn, document_id: str, model_id: str) -> None:
    conn.execute(
        """UPDATE app.embedding_jobs SET status = 'failed', error_class = 'bad_input',
                           error_message = 'rejected', updated_at = now()
                    WHERE model_id = %s AND chunk_checksum = (
                        SELECT c.chunk_checksum FROM app.chunks c JOIN app.documents d USING (doc_pk)
                        WHERE d.document_id = %s ORDER BY c.chunk_index LIMIT 1)""",
        (model_id, document_id),
    )


def test_two_models_keep_one_embed_row_each(pool, clean_db, tmp_path):
    conn = clean_db
    write_corpus(tmp_path / "src", 3)
    a, b = runtime(), runtime(SECOND_MODEL)
    ingest_source(a, pool, tmp_path / "src")
    with pool.connection() as c:
        assert register_model(c, b) > 0  # the second model gets jobs for every current chunk
    model_a, model_b = a.model_id, b.model_id
    docs = ["doc0000.md", "doc0001.md", "doc0002.md"]

    embed.work(a, pool, until_idle=True, poll_seconds=0.05)
    assert embed_rows(conn) == {(d, model_a): ("succeeded", None, 1) for d in docs}
    st = status_uc.status(pool, Settings.from_env())
    assert st.embed_by_model == {model_a: {"succeeded": 3}, model_b: {"pending": 3}}
    assert st.stages["embed"] == {"pending": 3}  # a document is embedded once every active model is

    embed.work(b, pool, until_idle=True, poll_seconds=0.05)
    # Each model has its own row: the second run did not take over the first model's rows.
    assert embed_rows(conn) == {(d, m): ("succeeded", None, 1) for d in docs for m in (model_a, model_b)}
    assert status_uc.status(pool, Settings.from_env()).stages["embed"] == {"succeeded": 3}

    # One document fails for the second model only.
    since = stage_runs.clock(conn)
    fail_job_of(conn, "doc0001.md", model_b)
    assert stage_runs.refresh_embed_touched(conn, model_b, since) == 1
    rows = embed_rows(conn)
    assert rows[("doc0001.md", model_b)] == ("failed", "bad_input", 1)
    assert rows[("doc0001.md", model_a)] == ("succeeded", None, 1)
    [target] = stage_runs.rerun_targets(conn, stage="embed", failed_only=True)
    assert (target.document_id, target.code_version, target.error_class) == ("doc0001.md", model_b, "bad_input")
    assert stage_runs.rerun_targets(conn, stage="embed", failed_only=True, model_id=model_a) == []
    assert len(stage_runs.rerun_targets(conn, stage="embed")) == 6
    st = status_uc.status(pool, Settings.from_env())
    assert st.embed_by_model == {model_a: {"succeeded": 3}, model_b: {"failed": 1, "succeeded": 2}}
    assert st.stages["embed"] == {"failed": 1, "succeeded": 2}
    # extract and chunk rows are untouched by the key change (model_id '').
    assert st.stages["extract"] == {"succeeded": 3} and st.stages["chunk"] == {"succeeded": 3}
    assert {r[0] for r in conn.execute("SELECT DISTINCT model_id FROM app.stage_runs WHERE stage <> 'embed'")} == {""}

    # A requeued dead letter that then succeeds: its stored 'failed' row is refreshed by the next run.
    conn.execute(
        "UPDATE app.embedding_jobs SET status = 'pending', attempts = 0, available_at = now() WHERE status = 'failed'"
    )
    embed.work(b, pool, until_idle=True, poll_seconds=0.05)
    assert embed_rows(conn)[("doc0001.md", model_b)][0] == "succeeded"


def test_a_work_run_refreshes_only_the_documents_it_touched(pool, clean_db, tmp_path):
    conn = clean_db
    src = tmp_path / "src"
    write_corpus(src, 4)
    a = runtime()
    ingest_source(a, pool, src)
    embed.work(a, pool, until_idle=True, poll_seconds=0.05)
    assert len(embed_rows(conn)) == 4
    # A marker on the rows of two documents the next run will not touch (any refresh of
    # them, a whole-corpus one included, would write 'succeeded' back).
    conn.execute("""UPDATE app.stage_runs SET status = 'skipped' WHERE stage = 'embed' AND doc_pk IN (
                    SELECT doc_pk FROM app.documents WHERE document_id IN ('doc0000.md', 'doc0001.md'))""")

    (src / "doc0002.md").write_text("# changed\n\nnew words for a new chunk\n")
    (src / "new.md").write_text("# new\n\nanother document entirely\n")
    ingest_source(a, pool, src)
    report = embed.work(a, pool, until_idle=True, poll_seconds=0.05)
    assert report.embedded == 2

    rows = embed_rows(conn)
    # Untouched: not rewritten.
    assert rows[("doc0000.md", a.model_id)] == ("skipped", None, 1)
    assert rows[("doc0001.md", a.model_id)] == ("skipped", None, 1)
    # Touched: the changed and the new document have their rows.
    assert rows[("doc0002.md", a.model_id)] == ("succeeded", None, 1)
    assert rows[("new.md", a.model_id)] == ("succeeded", None, 1)
    # reconcile keeps the full refresh.
    with pool.connection() as c:
        reconcile(c, a.options, model_id=a.model_id, rescan=False)
    assert embed_rows(conn) == {k: ("succeeded", None, 1) for k in rows}


def test_embed_documents_refreshes_its_documents_even_when_nothing_was_sent(pool, clean_db, tmp_path):
    conn = clean_db
    src = tmp_path / "src"
    write_corpus(src, 2)
    a = runtime()
    ingest_source(a, pool, src)
    embed.work(a, pool, until_idle=True, poll_seconds=0.05)
    conn.execute("DELETE FROM app.stage_runs WHERE stage = 'embed'")
    done = embed_selection.embed_and_wait(a, pool, src, ["doc0001.md"], poll_seconds=0.05)
    assert done.work.embedded == 0
    assert embed_rows(conn) == {("doc0001.md", a.model_id): ("succeeded", None, 1)}


def test_the_rows_are_written_at_the_drain_beside_the_index_build(pool, clean_db, tmp_path, monkeypatch):
    """While the index builds, the rows already say what the run did; what changes after the drain
    (a document embedded, a job failed) is in the rows when the run ends."""
    conn = clean_db
    src = tmp_path / "src"
    write_corpus(src, 3)
    a = runtime()
    ingest_source(a, pool, src)
    build_started, release = threading.Event(), threading.Event()
    real_build = background_build.build

    def held_build(*args, **kwargs):
        build_started.set()
        release.wait(120)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(background_build, "build", held_build)
    run = threading.Thread(target=embed.work, args=(a, pool), kwargs={"until_idle": True, "poll_seconds": 0.05})
    run.start()
    try:
        assert build_started.wait(120)
        drained = {(f"doc000{i}.md", a.model_id): ("succeeded", None, 1) for i in range(3)}
        wait_until(lambda: embed_rows(conn) == drained, timeout=30, what="the rows written at the drain")
        # After the drain: a new document embedded by the same run, and a job that failed.
        (src / "late.md").write_text("# late\n\nwritten while the index builds\n")
        ingest_source(a, pool, src)
        wait_until(
            lambda: conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 4,
            timeout=60,
            what="the late document's vector",
        )
        fail_job_of(conn, "doc0001.md", a.model_id)
    finally:
        release.set()
        run.join(120)
    assert not run.is_alive()
    rows = embed_rows(conn)
    assert rows == {
        **drained,
        ("doc0001.md", a.model_id): ("failed", "bad_input", 1),
        ("late.md", a.model_id): ("succeeded", None, 1),
    }


def test_a_drain_refresh_with_work_outstanding_vouches_for_nothing(pool, clean_db, tmp_path):
    """With a job of the model still outstanding the drain refresh vouches for nothing (None); with
    none, it returns its clock, and the rows it wrote hold."""
    conn = clean_db
    write_corpus(tmp_path / "src", 2)
    a = runtime()
    ingest_source(a, pool, tmp_path / "src")
    since = stage_runs.clock(conn)
    assert stage_runs.refresh_embed_drained(conn, a.model_id, since) is None
    embed.work(a, pool, until_idle=True, poll_seconds=0.05)
    conn.execute("DELETE FROM app.stage_runs WHERE stage = 'embed'")
    until = stage_runs.refresh_embed_drained(conn, a.model_id, since)
    assert until is not None and until >= since
    assert set(embed_rows(conn).values()) == {("succeeded", None, 1)} and len(embed_rows(conn)) == 2


# --------------------------------------------------------------------------- a read-only status


@pytest.fixture
def readonly_url(database_url):
    """A real role that can only SELECT in the test database, and whose transactions are read-only."""
    role = "ro_" + uuid.uuid4().hex[:10]
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE \"{role}\" LOGIN PASSWORD 'ro-pass'")
        admin.execute(f'GRANT USAGE ON SCHEMA app TO "{role}"')
        admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA app TO "{role}"')
        admin.execute(f'ALTER ROLE "{role}" SET default_transaction_read_only = on')
    yield psycopg.conninfo.make_conninfo(database_url, user=role, password="ro-pass")
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(f'DROP OWNED BY "{role}"')
        admin.execute(f'DROP ROLE "{role}"')


def test_status_is_read_only_and_runs_for_a_select_only_role(pool, clean_db, tmp_path, env, readonly_url):
    conn = clean_db
    write_corpus(tmp_path / "src", 3)
    a = runtime()
    ingest_source(a, pool, tmp_path / "src")
    embed.work(a, pool, until_idle=True, poll_seconds=0.05)
    fail_job_of(conn, "doc0002.md", a.model_id)
    # No stored embed rows at all: status must compute the stage, not write it.
    conn.execute("DELETE FROM app.stage_runs WHERE stage = 'embed'")
    with psycopg.connect(readonly_url) as ro:
        assert ro.execute("SHOW default_transaction_read_only").fetchone()[0] == "on"
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            ro.execute("DELETE FROM app.stage_runs")

    ro_pool = db.make_pool(readonly_url, max_size=2)
    try:
        st = status_uc.status(ro_pool, Settings.from_env())
    finally:
        ro_pool.close()
    assert st.stages["embed"] == {"failed": 1, "succeeded": 2}
    assert st.embed_by_model == {a.model_id: {"failed": 1, "succeeded": 2}}
    assert st.dead_letter == 1

    # The command line, as that role (it opens a pool on a migrated database: reads only).
    proc = cli("status", "--json", env={**env, "PIPELINE_DATABASE_URL": readonly_url})
    out = json.loads(proc.stdout)
    assert out["stages"]["embed"] == {"failed": 1, "succeeded": 2}
    assert out["jobs"]["failed"] == 1
    assert cli("status", env={**env, "PIPELINE_DATABASE_URL": readonly_url}).stdout.count("stage embed:") == 1
    assert conn.execute("SELECT count(*) FROM app.stage_runs WHERE stage = 'embed'").fetchone()[0] == 0
