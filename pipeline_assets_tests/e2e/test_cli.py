"""The CLI contract, end to end.

Every test runs the real ``pipeline-assets`` CLI in subprocesses against the
real test database and the fake OpenAI server over HTTP, and asserts on
outcomes: rows, stored vectors, exit codes, printed JSON, billed inputs.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import psycopg
import pytest

from pipeline_assets.store import migrations
from pipeline_assets_tests.conftest import FAKE_DIM, FAKE_MODEL, _with_dbname
from pipeline_assets_tests.data_helpers import assert_vectors_match, job_counts, write_corpus
from pipeline_assets_tests.fake_openai import FakeOpenAI
from pipeline_assets_tests.processes import cli, start_cli, wait_until

MODEL_ID = f"openai/{FAKE_MODEL}"  # dimension unknown up front: no "@16" suffix
JSON_EXPORT_KEYS = {"document_id", "source_uri", "chunk_index", "text", "model", "embedding"}
UNREACHABLE_DB = "postgresql://nobody@127.0.0.1:1/x"


# -- helpers ------------------------------------------------------------------


def cli_json(*args: str, env: dict):
    proc = cli(*args, env=env)
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(
            f"pipeline-assets {' '.join(args)} printed no JSON:\n{proc.stdout}\n{proc.stderr}"
        ) from None


def digest(conn, table: str, order: str) -> str:
    """md5 over the full text of every row of ``table`` in a fixed order: equal iff byte-identical."""
    return conn.execute(
        f"SELECT md5(coalesce(string_agg(t::text, E'\\n' ORDER BY {order}), '')), count(*) FROM {table} t"
    ).fetchone()


def distinct_chunk_texts(conn) -> list[str]:
    return [r[0] for r in conn.execute("SELECT DISTINCT text FROM app.chunks ORDER BY 1")]


def assert_one_line_error(proc, *, secret: str | None = None) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith("error:"), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    if secret:
        assert secret not in proc.stderr and secret not in proc.stdout
    return lines[0]


def export_rows(env: dict) -> list[dict]:
    proc = cli("export", env=env)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def dump_app_schema(conn) -> str:
    """The text of every row of every table in schema app."""
    tables = [
        r[0]
        for r in conn.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = 'app' ORDER BY 1")
    ]
    parts = []
    for t in tables:
        parts.append(conn.execute(f"SELECT coalesce(string_agg(x::text, E'\\n'), '') FROM app.{t} x").fetchone()[0])
    return "\n".join(parts)


@pytest.fixture
def corpus(tmp_path) -> Path:
    return tmp_path / "corpus"


@pytest.fixture
def fresh_db(server_url):
    """A brand-new, empty (unmigrated) database on the test server."""
    name = "t_fresh_" + uuid.uuid4().hex[:10]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield _with_dbname(server_url, name)
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- migrate ------------------------------------------------------------------


def test_migrate_twice_second_applies_nothing(env, fresh_db):
    env = {**env, "PIPELINE_DATABASE_URL": fresh_db}
    expected = [p.name for p in migrations.migration_files()]
    first = cli("migrate", env=env)
    assert first.stdout.startswith(f"applied {len(expected)} migration(s)"), first.stdout
    second = cli("migrate", env=env)
    assert second.stdout.strip() == "applied 0 migration(s)"
    with psycopg.connect(fresh_db) as c:
        versions = [r[0] for r in c.execute("SELECT version FROM app.schema_migrations ORDER BY 1")]
    assert versions == expected


def test_two_concurrent_migrates_on_new_database(env, fresh_db):
    env = {**env, "PIPELINE_DATABASE_URL": fresh_db}
    procs = [start_cli("migrate", env=env) for _ in range(2)]
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outputs.append(out.strip())
    expected = [p.name for p in migrations.migration_files()]
    # Exactly one of them applied everything, the other nothing.
    applied_counts = sorted(int(o.split()[1]) for o in outputs)
    assert applied_counts == [0, len(expected)], outputs
    with psycopg.connect(fresh_db) as c:
        rows = c.execute("SELECT version, count(*) FROM app.schema_migrations GROUP BY 1 ORDER BY 1").fetchall()
    assert rows == [(name, 1) for name in expected]


# -- ingest -------------------------------------------------------------------


def test_ingest_twice_is_a_byte_identical_noop(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 300)
    first = cli_json("ingest", str(corpus), "--json", env=env)
    assert first["scanned"] == 300 and first["new"] == 300 and first["quarantined"] == 0
    n_chunks = conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
    assert first["chunks"] == n_chunks >= 300
    distinct = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    assert first["enqueued"] == distinct
    assert job_counts(conn) == {"pending": distinct}
    tables = (
        ("app.embedding_jobs", "t.job_id"),
        ("app.chunks", "t.doc_pk, t.chunk_index"),
        ("app.documents", "t.doc_pk"),
        ("app.stage_runs", "t.doc_pk, t.stage"),
    )
    before = {t: digest(conn, t, o) for t, o in tables}

    second = cli_json("ingest", str(corpus), "--json", env=env)
    assert second["scanned"] == 300
    assert (second["new"], second["changed"], second["unchanged"]) == (0, 0, 300)
    assert (second["chunks"], second["enqueued"], second["superseded"], second["deleted"]) == (0, 0, 0, 0)
    after = {t: digest(conn, t, o) for t, o in tables}
    assert after == before
    # Ingest never talks to the provider.
    assert fake.stats["requests"] == 0


# -- embed --------------------------------------------------------------------


def test_embed_summary_vectors_reuse_and_dedup(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 12)
    shared = "# shared\n\nthe very same words in two different files\n"
    (corpus / "copy_a.md").write_text(shared)
    (corpus / "sub").mkdir()
    (corpus / "sub" / "copy_b.md").write_text(shared)

    s = cli_json("embed", str(corpus), "--json", env=env)
    n_docs = conn.execute("SELECT count(*) FROM app.documents WHERE status = 'current'").fetchone()[0]
    n_chunks = conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
    distinct = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    assert n_docs == 14 and distinct == n_chunks - 1  # the two copies share one chunk
    assert s["model"] == MODEL_ID
    assert s["documents"] == n_docs
    assert s["chunks"] == n_chunks
    assert s["embedded"] == distinct
    assert (
        conn.execute("SELECT count(*) FROM app.embeddings WHERE model_id = %s", (MODEL_ID,)).fetchone()[0] == distinct
    )
    assert (
        s["provider_calls"]
        == fake.stats["requests"]
        == conn.execute("SELECT count(*) FROM app.provider_calls").fetchone()[0]
        >= 1
    )
    assert s["failed"] == 0 and s["coverage"] == f"{distinct}/{distinct}"
    assert job_counts(conn) == {"ready": distinct}
    assert assert_vectors_match(conn, fake) == n_chunks
    # Identical texts in two files: billed exactly once; every text billed exactly once.
    shared_text = conn.execute(
        "SELECT c.text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = 'copy_a.md'"
    ).fetchone()[0]
    assert fake.billed_count(shared_text) == 1
    assert all(fake.billed_count(t) == 1 for t in distinct_chunk_texts(conn))
    assert fake.stats["billed_inputs"] == distinct

    requests_before = fake.stats["requests"]
    again = cli_json("embed", str(corpus), "--json", env=env)
    assert again["provider_calls"] == 0 and again["embedded"] == 0
    assert again["reused"] == distinct
    assert again["documents_changed"] == 0
    assert fake.stats["requests"] == requests_before


def test_edit_and_delete_supersede_old_content(env, fake, clean_db, corpus):
    conn = clean_db
    paths = write_corpus(corpus, 5)
    cli("embed", str(corpus), env=env)
    old = {
        doc: conn.execute(
            "SELECT c.chunk_checksum, c.text FROM app.chunks c JOIN app.documents d USING (doc_pk)"
            " WHERE d.document_id = %s",
            (doc,),
        ).fetchall()
        for doc in ("doc0000.md", "doc0001.md")
    }
    assert all(old.values())

    new_text = "# doc 0 rewritten\n\ncompletely new words zebra quokka axolotl"
    paths[0].write_text(new_text + "\n")
    paths[1].unlink()
    s = cli_json("embed", str(corpus), "--json", env=env)
    assert s["documents_changed"] == 1 and s["deleted"] == 1 and s["embedded"] == 1

    rows = export_rows(env)
    texts = [r["text"] for r in rows]
    assert new_text in texts
    for _, old_text in old["doc0000.md"] + old["doc0001.md"]:
        assert old_text not in texts
    assert not [r for r in rows if r["document_id"] == "doc0001.md"]
    assert {r["document_id"] for r in rows} == {"doc0000.md", "doc0002.md", "doc0003.md", "doc0004.md"}

    for checksum, _ in old["doc0000.md"] + old["doc0001.md"]:
        status = conn.execute(
            "SELECT status FROM app.embedding_jobs WHERE chunk_checksum = %s AND model_id = %s", (checksum, MODEL_ID)
        ).fetchone()[0]
        assert status == "superseded"
        assert (
            conn.execute("SELECT count(*) FROM app.embeddings WHERE chunk_checksum = %s", (checksum,)).fetchone()[0]
            == 0
        )
    assert conn.execute("SELECT status FROM app.documents WHERE document_id = 'doc0001.md'").fetchone()[0] == "deleted"
    assert assert_vectors_match(conn, fake) == len(rows)


# -- status -------------------------------------------------------------------


def test_status_json_after_embed(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 6)
    cli("embed", str(corpus), env=env)
    st = cli_json("status", "--json", env=env)
    for key in ("jobs", "stages", "coverage", "dead_letter", "superseded", "spend"):
        assert key in st, key
    distinct = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    cov = st["coverage"][MODEL_ID]
    assert cov["ready"] == cov["wanted"] == distinct
    assert st["jobs"] == {"ready": distinct}
    assert st["dead_letter"] == 0 and st["superseded"] == 0
    assert st["stages"]["extract"] == {"succeeded": 6}
    assert st["stages"]["chunk"] == {"succeeded": 6}
    assert st["stages"]["embed"] == {"succeeded": 6}
    assert st["spend"][MODEL_ID]["calls"] == fake.stats["requests"]
    assert st["spend"][MODEL_ID]["inputs_ok"] == fake.stats["billed_inputs"] == distinct
    assert st["spend"][MODEL_ID]["tokens"] == fake.stats["billed_tokens"]


# -- dead letters ---------------------------------------------------------------


def test_dlq_poison_quarantine_and_requeue(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 8)
    (corpus / "poisoned.md").write_text("# bad\n\nthis chunk carries the POISON word\n")
    (corpus / "blob.bin").write_bytes(b"\x00\x01\x02binary\x00" * 20)
    (corpus / "huge.txt").write_text("x" * 5000)
    env = {**env, "PIPELINE_MAX_INPUT_BYTES": "4000"}
    fake.poison_marker = "POISON"

    s = cli_json("embed", str(corpus), "--json", env=env)
    assert s["quarantined"] == 2 and s["failed"] == 1
    distinct = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    assert job_counts(conn) == {"ready": distinct - 1, "failed": 1}

    items = cli_json("dlq", "list", "--json", env=env)
    jobs = [i for i in items if i["kind"] == "job"]
    docs = {i["id"]: i for i in items if i["kind"] == "document"}
    assert len(jobs) == 1
    assert jobs[0]["documents"] == ["poisoned.md"]
    assert jobs[0]["error_class"] == "bad_input"
    assert jobs[0]["model"] == MODEL_ID
    assert set(docs) == {"blob.bin", "huge.txt"}
    assert docs["blob.bin"]["error_class"] == "unsupported_binary"
    assert docs["huge.txt"]["error_class"] == "too_large"
    # The rest of the corpus is ready with correct vectors.
    poison_text = conn.execute(
        "SELECT c.text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = 'poisoned.md'"
    ).fetchone()[0]
    for text in distinct_chunk_texts(conn):
        row = conn.execute(
            """SELECT j.status, e.embedding FROM app.chunks c
                              JOIN app.embedding_jobs j USING (chunk_checksum)
                              LEFT JOIN app.embeddings e USING (chunk_checksum, model_id)
                              WHERE c.text = %s LIMIT 1""",
            (text,),
        ).fetchone()
        if text == poison_text:
            assert row[0] == "failed" and row[1] is None
        else:
            assert row[0] == "ready" and np.allclose(row[1].to_numpy(), fake.vector_for(text), atol=1e-6)

    fake.poison_marker = None
    req = cli("dlq", "requeue", "--all", env=env)
    assert req.stdout.strip() == "requeued=1 superseded=0"
    cli("work", "--until-idle", env=env)
    assert job_counts(conn) == {"ready": distinct}
    assert fake.billed_count(poison_text) == 1
    assert assert_vectors_match(conn, fake) == conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
    remaining = cli_json("dlq", "list", "--json", env=env)
    assert [i["kind"] for i in remaining] == ["document", "document"]


# -- export / search --------------------------------------------------------------


def test_export_jsonl_contract(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 7)
    cli("embed", str(corpus), env=env)
    rows = export_rows(env)
    assert len(rows) == conn.execute("SELECT count(*) FROM app.chunks").fetchone()[0]
    for r in rows:
        assert set(r) == JSON_EXPORT_KEYS
        assert r["model"] == FAKE_MODEL
        assert fake.billed_count(r["text"]) >= 1
        assert len(r["embedding"]) == FAKE_DIM
        assert np.allclose(r["embedding"], fake.vector_for(r["text"]), atol=1e-6)
        assert r["source_uri"] == (corpus / r["document_id"]).resolve().as_uri()
    assert [(r["document_id"], r["chunk_index"]) for r in rows] == sorted(
        (r["document_id"], r["chunk_index"]) for r in rows
    )


def test_search_nearest_first(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 10)
    cli("embed", str(corpus), env=env)
    target_doc, target_idx, target_text = conn.execute(
        "SELECT d.document_id, c.chunk_index, c.text FROM app.chunks c JOIN app.documents d USING (doc_pk)"
        " WHERE d.document_id = 'doc0004.md' ORDER BY c.chunk_index LIMIT 1"
    ).fetchone()
    hits = cli_json("search", target_text, "-k", "3", "--mode", "vector", "--json", env=env)
    assert len(hits) == 3
    distances = [h["distance"] for h in hits]
    assert distances == sorted(distances)
    assert (hits[0]["document_id"], hits[0]["chunk_index"], hits[0]["text"]) == (target_doc, target_idx, target_text)
    assert hits[0]["distance"] == pytest.approx(0.0, abs=1e-5)
    assert all(d > 1e-3 for d in distances[1:])
    # The distances are the true cosine distances of the fake's vectors.
    q = np.asarray(fake.vector_for(target_text))
    for h in hits:
        v = np.asarray(fake.vector_for(h["text"]))
        assert h["distance"] == pytest.approx(1 - float(q @ v) / (np.linalg.norm(q) * np.linalg.norm(v)), abs=1e-4)


# -- reconcile ------------------------------------------------------------------------


def test_reconcile_noop_then_repairs_deleted_vector(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 6)
    cli("embed", str(corpus), env=env)
    jobs_before = digest(conn, "app.embedding_jobs", "t.job_id")
    r = cli_json("reconcile", "--json", env=env)
    assert r["sources"] == 1 and r["missing_sources"] == []
    for key in ("changed", "new", "deleted", "enqueued", "revived", "superseded", "repaired_vectors", "rescued"):
        assert r[key] == 0, (key, r)
    assert digest(conn, "app.embedding_jobs", "t.job_id") == jobs_before

    checksum, text = conn.execute("SELECT chunk_checksum, text FROM app.chunks ORDER BY doc_pk LIMIT 1").fetchone()
    assert conn.execute("DELETE FROM app.embeddings WHERE chunk_checksum = %s", (checksum,)).rowcount == 1
    r = cli_json("reconcile", "--json", env=env)
    assert r["repaired_vectors"] == 1
    assert (
        conn.execute("SELECT status FROM app.embedding_jobs WHERE chunk_checksum = %s", (checksum,)).fetchone()[0]
        == "pending"
    )
    cli("work", "--until-idle", env=env)
    distinct = conn.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
    assert job_counts(conn) == {"ready": distinct}
    vec = conn.execute("SELECT embedding FROM app.embeddings WHERE chunk_checksum = %s", (checksum,)).fetchone()[0]
    assert np.allclose(vec.to_numpy(), fake.vector_for(text), atol=1e-6)
    assert fake.billed_count(text) == 2  # the repair re-sent exactly that one text


# -- rerun ----------------------------------------------------------------------------


def test_rerun_stale_extract_reextracts_without_new_work(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 5)
    cli("embed", str(corpus), env=env)
    assert {r[0] for r in conn.execute("SELECT code_version FROM app.stage_runs WHERE stage = 'extract'")} == {
        "extract-1"
    }
    jobs_before = conn.execute(
        "SELECT job_id, chunk_checksum, status, attempts FROM app.embedding_jobs ORDER BY job_id"
    ).fetchall()
    vectors_before = digest(conn, "app.embeddings", "t.chunk_checksum, t.model_id")
    fake.reset_stats()

    env2 = {**env, "PIPELINE_EXTRACTOR_VERSION": "extract-2"}
    out = cli("rerun", "--stage", "extract", "--stale", env=env2)
    assert out.stdout.strip() == "reran extract for 5 document(s)"
    rows = conn.execute("SELECT status, code_version, attempts FROM app.stage_runs WHERE stage = 'extract'").fetchall()
    assert len(rows) == 5 and all(r[:2] == ("succeeded", "extract-2") and r[2] == 2 for r in rows)
    assert {r[0] for r in conn.execute("SELECT extractor_version FROM app.documents")} == {"extract-2"}
    assert (
        conn.execute(
            "SELECT job_id, chunk_checksum, status, attempts FROM app.embedding_jobs ORDER BY job_id"
        ).fetchall()
        == jobs_before
    )
    assert digest(conn, "app.embeddings", "t.chunk_checksum, t.model_id") == vectors_before
    # Nothing to do for a worker, and nothing is stale any more.
    w = cli_json("work", "--until-idle", "--json", env=env2)
    assert w["provider_calls"] == 0 and w["embedded"] == 0
    assert fake.stats["requests"] == 0
    again = cli("rerun", "--stage", "extract", "--stale", env=env2)
    assert again.stdout.strip() == "reran extract for 0 document(s)"


# -- bad input ------------------------------------------------------------------------


def test_missing_directory_is_one_line_error(env, fake, clean_db, tmp_path):
    for cmd in ("ingest", "embed"):
        proc = cli(cmd, str(tmp_path / "does-not-exist"), env=env, check=False, process=True)  # exit status 1
        line = assert_one_line_error(proc)
        assert "does-not-exist" in line
    assert fake.stats["requests"] == 0


def test_unreachable_database_is_one_line_error(env, corpus):
    write_corpus(corpus, 2)
    env = {**env, "PIPELINE_DATABASE_URL": UNREACHABLE_DB}
    for args in (("status", "--json"), ("ingest", str(corpus))):
        proc = cli(*args, env=env, check=False, timeout=60, process=True)
        line = assert_one_line_error(proc)
        assert "127.0.0.1" in line, line


def test_wrong_api_key_is_fatal_and_touches_nothing(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 6)
    cli("ingest", str(corpus), env=env)
    before = conn.execute(
        "SELECT job_id, status, attempts, error_class, error_message FROM app.embedding_jobs ORDER BY job_id"
    ).fetchall()
    assert before and all(r[1:] == ("pending", 0, None, None) for r in before)
    key = "sk-wrongkey123456"
    bad = {**env, "OPENAI_API_KEY": key}
    proc = cli("work", "--until-idle", env=bad, check=False, timeout=60)
    line = assert_one_line_error(proc, secret=key)
    assert "auth" in line or "401" in line, line
    # A real process: whatever reaches its stderr (file descriptor 2, not only sys.stderr) is read.
    verbose = cli("-v", "work", "--until-idle", env=bad, check=False, timeout=60, process=True)
    assert verbose.returncode == 1
    assert key not in verbose.stdout + verbose.stderr and "Traceback" not in verbose.stderr
    assert fake.stats["responses_by_status"].get(401, 0) >= 2
    assert fake.stats["billed_inputs"] == 0
    after = conn.execute(
        "SELECT job_id, status, attempts, error_class, error_message FROM app.embedding_jobs ORDER BY job_id"
    ).fetchall()
    assert after == before
    assert key not in dump_app_schema(conn)
    assert "wrongkey" not in dump_app_schema(conn)


def test_unknown_model_is_fatal_and_touches_nothing(env, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 4)
    with FakeOpenAI(dim=FAKE_DIM, models={FAKE_MODEL}) as strict:
        menv = {**env, "OPENAI_BASE_URL": strict.base_url, "PIPELINE_EMBEDDING_MODEL": "nope"}
        cli("ingest", str(corpus), env=menv)
        before = conn.execute(
            "SELECT job_id, model_id, status, attempts FROM app.embedding_jobs ORDER BY job_id"
        ).fetchall()
        assert before and all(r[1:] == ("openai/nope", "pending", 0) for r in before)
        proc = cli("work", "--until-idle", env=menv, check=False, timeout=60)
        line = assert_one_line_error(proc)
        assert "model_not_found" in line or "nope" in line, line
        assert strict.stats["responses_by_status"].get(404, 0) >= 1
        assert strict.stats["billed_inputs"] == 0
        embed = cli("embed", str(corpus), env=menv, check=False, timeout=60)
        assert_one_line_error(embed)
    after = conn.execute("SELECT job_id, model_id, status, attempts FROM app.embedding_jobs ORDER BY job_id").fetchall()
    assert after == before
    assert conn.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 0


def test_search_provider_failure_is_one_line_error(env, fake, clean_db, corpus):
    """search embeds the query itself: a provider failure there is as expected as in work."""
    write_corpus(corpus, 3)
    cli("embed", str(corpus), env=env)
    key = "sk-wrongkey123456"
    proc = cli("search", "w1 w2 w3", "--json", env={**env, "OPENAI_API_KEY": key}, check=False, timeout=60)
    assert fake.stats["responses_by_status"].get(401, 0) == 1
    line = assert_one_line_error(proc, secret=key)
    assert "401" in line or "auth" in line, line
    with FakeOpenAI(dim=FAKE_DIM, models={FAKE_MODEL}) as strict:
        # (search reads the served model whatever is configured; --model picks another)
        proc = cli(
            "search",
            "w1",
            "--json",
            "--model",
            "nope",
            env={**env, "OPENAI_BASE_URL": strict.base_url},
            check=False,
            timeout=60,
        )
        assert strict.stats["responses_by_status"].get(404, 0) == 1
    assert_one_line_error(proc)


# -- signals --------------------------------------------------------------------------


def test_work_exits_promptly_on_sigterm(env, fake, clean_db, corpus):
    conn = clean_db
    write_corpus(corpus, 80)
    cli("ingest", str(corpus), env=env)
    total = conn.execute("SELECT count(*) FROM app.embedding_jobs").fetchone()[0]
    fake.latency = 0.1
    wenv = {**env, "PIPELINE_BATCH_INPUTS": "2"}
    proc = start_cli("work", "--concurrency", "2", env=wenv)
    try:
        wait_until(lambda: job_counts(conn).get("ready", 0) >= 4, timeout=30, what="some jobs ready")
        # Stall the provider so calls are in flight (and would not return soon) when the signal lands.
        fake.latency = 600
        wait_until(
            lambda: (lambda st: st["requests"] > sum(st["responses_by_status"].values()))(fake.stats),
            timeout=60,
            what="a provider call in flight",
        )
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        _out, err = proc.communicate(timeout=300)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert elapsed < 300  # not the 600 s the stalled calls would take (a bound against a hang only)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    counts = job_counts(conn)
    assert "processing" not in counts, counts
    assert 4 <= counts.get("ready", 0) < total, counts
    # Jobs not done were handed back without losing an attempt.
    assert (
        conn.execute(
            "SELECT count(*) FROM app.embedding_jobs WHERE status <> 'ready'"
            " AND (status <> 'pending' OR attempts <> 0 OR lease_owner IS NOT NULL)"
        ).fetchone()[0]
        == 0
    )
    # A later run finishes the rest.
    fake.latency = 0.0
    cli("work", "--until-idle", env=env)
    assert job_counts(conn) == {"ready": total}
    assert_vectors_match(conn, fake)


def test_model_change_then_retire_old_model(env, fake, clean_db, tmp_path):
    """Switch models: the new one embeds everything once; the retired one stops getting work."""
    corpus = tmp_path / "models"
    write_corpus(corpus, 5)
    cli("embed", str(corpus), env=env)
    new_env = {**env, "PIPELINE_EMBEDDING_MODEL": "fake-embed-v2"}
    summary = json.loads(cli("embed", str(corpus), "--json", env=new_env).stdout)
    ready, wanted = summary["coverage"].split("/")
    assert summary["embedded"] > 0 and ready == wanted
    listed = {m["name"]: m for m in json.loads(cli("models", "list", "--json", env=new_env).stdout)}
    assert listed[FAKE_MODEL]["ready"] == listed["fake-embed-v2"]["ready"] > 0
    assert listed[FAKE_MODEL]["served"] and not listed["fake-embed-v2"]["served"]
    cli("models", "serve", "fake-embed-v2", env=new_env)  # the served model cannot be retired
    out = cli("models", "retire", FAKE_MODEL, env=new_env).stdout
    assert out.startswith("retired openai/fake-embed")
    (corpus / "doc0000.md").write_text("new content after the model change")
    cli("embed", str(corpus), env=new_env)
    conn = clean_db
    outstanding = conn.execute("""SELECT count(*) FROM app.embedding_jobs j JOIN app.models m USING (model_id)
                                  WHERE NOT m.active AND j.status IN ('pending', 'retry')""").fetchone()[0]
    assert outstanding == 0  # nothing waits for a worker that will never come
    exported = [json.loads(line) for line in cli("export", "--model", FAKE_MODEL, env=new_env).stdout.splitlines()]
    assert exported and all(r["model"] == FAKE_MODEL for r in exported)  # the old index stays readable


def test_the_lazy_command_table_names_every_command_of_every_module():
    """`pipeline-assets` imports a command's module only when it runs: its table of names must
    hold exactly the commands the modules define (a new command is added to both)."""
    from pipeline_assets.cli import root

    defined = {name: module for module in set(root.COMMAND_MODULES.values()) for name in root.module_commands(module)}
    assert defined == root.COMMAND_MODULES
    modules = {p.stem for p in (Path(root.__file__).parent).glob("*.py") if "COMMANDS = " in p.read_text()}
    assert modules == set(root.COMMAND_MODULES.values())
