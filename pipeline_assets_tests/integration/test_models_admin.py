"""Retiring a model is sticky: anything still configured
with a retired model is refused with one line, bills nothing, and does not
reactivate it; `models activate` brings it back, with jobs for what it lacks.
And `export` streams through a server-side cursor."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import psycopg
import pytest

from pipeline_assets.app import model_admin
from pipeline_assets.app import search as search_uc
from pipeline_assets.app.ingest import register_model
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.jobqueue import transitions
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings
from pipeline_assets.store import db, retrieval
from pipeline_assets_tests import job_helpers
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import job_counts, write_corpus
from pipeline_assets_tests.processes import cli

MODEL_ID = f"openai/{FAKE_MODEL}"
OTHER_MODEL = "fake-embed-2"
REFUSAL = f"error: model {MODEL_ID} was retired; run `pipeline-assets models activate {MODEL_ID}` to use it again"
SPEC = ModelSpec(
    provider="test", name="adm", dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
)


def add_document(conn, texts: list[str], name: str = "d") -> int:
    source_id = conn.execute(
        "INSERT INTO app.sources (root) VALUES ('/adm') ON CONFLICT (root) DO UPDATE"
        " SET root = EXCLUDED.root RETURNING source_id"
    ).fetchone()[0]
    doc_pk = conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status, source_checksum)"
        " VALUES (%s, %s, %s, 'current', %s) RETURNING doc_pk",
        (source_id, name, f"file:///{name}", b"\x01"),
    ).fetchone()[0]
    for i, t in enumerate(texts):
        conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start,"
            " char_end) VALUES (%s, %s, %s, %s, 3, 0, 10)",
            (doc_pk, i, hashlib.sha256(t.encode()).digest(), t),
        )
    return doc_pk


def active(conn, model_id: str) -> bool:
    return conn.execute("SELECT active FROM app.models WHERE model_id = %s", (model_id,)).fetchone()[0]


# --------------------------------------------------------------------------- retire is sticky


def test_every_command_configured_with_a_retired_model_is_refused_until_activated(env, fake, clean_db, tmp_path):
    """Before: `work`, `ingest`, `embed` and `reconcile` silently re-activated the model and billed again."""
    corpus = tmp_path / "c"
    write_corpus(corpus, 4)
    cli("embed", str(corpus), env=env)
    # The served model cannot be retired: another one is added, embedded and served first.
    assert cli("models", "retire", FAKE_MODEL, env=env, check=False).stderr.startswith(
        f"error: model {MODEL_ID} is served"
    )
    cli("models", "add", OTHER_MODEL, env=env)
    cli("work", "--until-idle", env={**env, "PIPELINE_EMBEDDING_MODEL": OTHER_MODEL})
    cli("models", "serve", OTHER_MODEL, env=env)
    assert cli("models", "retire", FAKE_MODEL, env=env).stdout.startswith(f"retired {MODEL_ID}")
    (corpus / "doc0000.md").write_text("changed after the retire")
    billed = fake.stats["billed_inputs"]
    for args in (("work", "--until-idle"), ("ingest", str(corpus)), ("embed", str(corpus)), ("reconcile",)):
        proc = cli(*args, env=env, check=False)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert proc.stderr.splitlines() == [REFUSAL], (args, proc.stderr)
    assert fake.stats["billed_inputs"] == billed
    assert not active(clean_db, MODEL_ID)
    listed, _ = json.loads(cli("models", "list", "--json", env=env).stdout)
    assert listed["model_id"] == MODEL_ID and listed["active"] is False and listed["served"] is False

    out = cli("models", "activate", FAKE_MODEL, env=env).stdout.strip()
    assert out == f"activated {MODEL_ID}: 0 job(s) revived, 0 enqueued"
    assert cli("models", "activate", FAKE_MODEL, env=env).stdout.strip() == f"{MODEL_ID} is already active"
    summary = json.loads(cli("embed", str(corpus), "--json", env=env).stdout)
    assert summary["embedded"] == 1 and summary["coverage"] == "4/4"
    assert fake.stats["billed_inputs"] == billed + 1  # only the changed document
    assert fake.billed_count("changed after the retire") == 1


def test_a_use_case_with_a_retired_model_raises_one_line(env, clean_db):
    """What the Dagster assets and sensors call (register_model) refuses too."""
    rt = Runtime.build(Settings.from_env())
    assert register_model(clean_db, rt) == 0
    models.retire(clean_db, rt.model_id)
    with pytest.raises(models.ModelRetired) as refused:
        register_model(clean_db, rt)
    assert str(refused.value) == REFUSAL.removeprefix("error: ")
    assert not active(clean_db, rt.model_id)


def test_activate_revives_superseded_jobs_and_enqueues_what_arrived_meanwhile(clean_db):
    conn = clean_db
    assert models.ensure_model(conn, SPEC)
    doc = add_document(conn, ["one", "two"])
    transitions.enqueue_for_docs(conn, [doc], 3)
    [first, _] = [*transitions.claim(conn, model_id=SPEC.model_id, owner="w", limit=1, lease_seconds=60), None]
    job_helpers.complete(conn, owner="w", job_ids=[first.job_id], vectors=[np.ones(4, dtype=np.float32)])
    assert models.retire(conn, SPEC.model_id) == 1  # the unstarted job
    later = add_document(conn, ["three"], name="later")
    assert transitions.enqueue_for_docs(conn, [later], 3) == 0  # no active model wants it
    with pytest.raises(models.ModelRetired):
        models.ensure_model(conn, SPEC)

    assert model_admin.reactivate(conn, SPEC.model_id, 3) == (True, 1, 1)
    assert job_counts(conn) == {"ready": 1, "pending": 2}
    assert not models.ensure_model(conn, SPEC)  # active again: registering is a no-op
    assert model_admin.reactivate(conn, SPEC.model_id, 3) == (False, 0, 0)


# --------------------------------------------------------------------------- export streams


@pytest.fixture
def exported_model(clean_db):
    conn = clean_db
    models.ensure_model(conn, SPEC)
    texts = [f"chunk {i}" for i in range(retrieval.EXPORT_FETCH_ROWS + 7)]
    doc = add_document(conn, texts)
    transitions.enqueue_for_docs(conn, [doc], 3)
    jobs = transitions.claim(conn, model_id=SPEC.model_id, owner="w", limit=len(texts), lease_seconds=60)
    job_helpers.complete(
        conn,
        owner="w",
        job_ids=[j.job_id for j in jobs],
        vectors=[np.array([1, 0, 0, int(j.text.split()[1])], dtype=np.float32) for j in jobs],
    )
    return len(texts)


def test_export_reads_through_a_server_side_cursor(database_url, exported_model):
    """Before: under autocommit (every pooled connection is) export used a client-side
    cursor, which loads every row of the result into memory before the first is written."""
    conn = db.connect(database_url)  # autocommit, as the pool's connections are
    try:
        rows = retrieval.export_rows(conn, SPEC.model_id)
        first = next(rows)
        assert conn.execute("SELECT name FROM pg_cursors").fetchall() == [(retrieval.EXPORT_CURSOR,)]
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        rest = list(rows)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn.execute("SELECT count(*) FROM pg_cursors").fetchone()[0] == 0
    finally:
        conn.close()
    assert 1 + len(rest) == exported_model
    by_index = {r["chunk_index"]: r for r in [first, *rest]}
    assert sorted(by_index) == list(range(exported_model))
    assert by_index[3]["embedding"] == [1.0, 0.0, 0.0, 3.0] and by_index[3]["text"] == "chunk 3"


def test_an_export_stopped_early_leaves_the_connection_clean(database_url, exported_model):
    """`export | head`: the reader goes away; the transaction is rolled back, the connection reusable."""
    with db.make_pool(database_url, max_size=1) as pool:
        rows = search_uc.export(pool, SPEC.model_id)
        assert next(rows)["model"] == "adm"
        rows.close()
        with pool.connection(timeout=60) as conn:  # a connection left checked out never comes
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert conn.execute("SELECT count(*) FROM pg_cursors").fetchone()[0] == 0
        assert sum(1 for _ in search_uc.export(pool, SPEC.model_id)) == exported_model
