"""The per-model vector index.

Models over 2,000 dimensions get a halfvec index up to 4,000 and none above
(exact search); a build error is one line or a logged warning, never a lost
run; the build is concurrent (completions commit while it runs), drops and
rebuilds an INVALID index, and reconcile never waits on it; search works
before the index exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import psycopg
import pytest
from psycopg import sql

from pipeline_assets.app import search as search_uc
from pipeline_assets.app.ingest_config import IngestConfig
from pipeline_assets.app.reconcile import reconcile
from pipeline_assets.app.runtime import IngestOptions, Runtime, chunker_for
from pipeline_assets.jobqueue import transitions
from pipeline_assets.jobqueue.worker import Worker
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import background_build, index_memory, models, vector_index
from pipeline_assets.settings import Settings
from pipeline_assets.store import db, retrieval
from pipeline_assets_tests import job_helpers
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.fake_openai import FakeOpenAI
from pipeline_assets_tests.processes import cli, wait_until

MODEL_ID = f"openai/{FAKE_MODEL}"


def spec(dim: int, name: str = "vi") -> ModelSpec:
    return ModelSpec(
        provider="test", name=name, dimension=dim, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
    )


def unit(rng: np.random.Generator, dim: int) -> np.ndarray:
    v = rng.standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def seed_ready(conn, s: ModelSpec, vectors: list[np.ndarray], *, prefix: str = "t") -> list[str]:
    """One current document whose chunks t0..tn have ready jobs with these vectors; returns the texts."""
    models.ensure_model(conn, s)
    source_id = conn.execute(
        "INSERT INTO app.sources (root) VALUES ('/vi') ON CONFLICT (root) DO UPDATE"
        " SET root = EXCLUDED.root RETURNING source_id"
    ).fetchone()[0]
    doc = f"{prefix}-{uuid.uuid4().hex[:6]}"
    doc_pk = conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status, source_checksum)"
        " VALUES (%s, %s, %s, 'current', %s) RETURNING doc_pk",
        (source_id, doc, f"file:///{doc}", b"\x01"),
    ).fetchone()[0]
    texts = [f"{doc} chunk {i}" for i in range(len(vectors))]
    for i, t in enumerate(texts):
        conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start,"
            " char_end) VALUES (%s, %s, %s, %s, 3, 0, 10)",
            (doc_pk, i, hashlib.sha256(t.encode()).digest(), t),
        )
    transitions.enqueue_for_docs(conn, [doc_pk], 3)
    claimed = transitions.claim(conn, model_id=s.model_id, owner="seed", limit=len(texts), lease_seconds=60)
    by_text = {c.text: c.job_id for c in claimed}
    ready, _ = job_helpers.complete(conn, owner="seed", job_ids=[by_text[t] for t in texts], vectors=vectors)
    assert len(ready) == len(texts)
    return texts


def index_row(conn, model_id: str):
    return conn.execute(
        "SELECT i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i"
        " JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = %s",
        (vector_index.index_name(model_id),),
    ).fetchone()


def uses_index(conn, model_id: str, dim: int) -> bool:
    """Whether search's query can use the model's index (sequential scans and sorts discouraged:
    on a few rows the planner would rightly prefer them)."""
    query = sql.SQL("EXPLAIN ") + sql.SQL(retrieval.RETRIEVAL.nearest).format(
        kind=sql.Identifier(vector_index.search_kind(dim)), dim=sql.Literal(dim)
    )
    with conn.transaction():
        conn.execute("SET LOCAL enable_seqscan = off")
        conn.execute("SET LOCAL enable_sort = off")
        conn.execute(retrieval.RETRIEVAL.set_ef_search, {"ef_search": "40"})
        plan = "\n".join(
            r[0]
            for r in conn.execute(
                query, {"q": np.zeros(dim, dtype=np.float32) + 0.1, "model": model_id, "fetch": 8, "k": 2}
            )
        )
    return vector_index.index_name(model_id) in plan


@pytest.fixture(autouse=True)
def no_vector_indexes(conn):
    """clean_db empties the tables but keeps indexes: a model id reused with another
    dimension (openai/fake-embed at 3,072 then 4,100) must not meet the old one's index."""
    for (name,) in conn.execute(
        "SELECT indexname FROM pg_indexes WHERE schemaname = 'app' AND indexname LIKE 'embeddings_hnsw_%%'"
    ).fetchall():
        conn.execute(sql.SQL("DROP INDEX app.{}").format(sql.Identifier(name)))


@pytest.fixture
def blocker(database_url):
    """A connection whose open transaction has written to app.embeddings (a RowExclusiveLock held)."""
    c = db.connect(database_url)
    yield c
    c.close()


def hold_write_lock(conn) -> None:
    conn.execute("BEGIN")
    conn.execute("LOCK TABLE app.embeddings IN ROW EXCLUSIVE MODE")


def builder_waiting(conn, pid_holder: dict) -> bool:
    row = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE query LIKE '%%CREATE INDEX CONCURRENTLY%%'"
        " AND wait_event_type = 'Lock' AND datname = current_database()"
        " AND pid <> pg_backend_pid()"
    ).fetchone()
    if row:
        pid_holder["pid"] = row[0]
    return bool(row)


# --------------------------------------------------------------------------- kinds


def test_index_kind_follows_pgvector_limits():
    assert [vector_index.index_kind(d) for d in (4, 1536, 2000, 2001, 3072, 4000, 4001, 8192)] == [
        "vector",
        "vector",
        "vector",
        "halfvec",
        "halfvec",
        "halfvec",
        None,
        None,
    ]
    assert vector_index.search_kind(4100) == "vector"


# --------------------------------------------------------------------------- end to end, real CLI


def test_embed_with_3072_dimensions_builds_a_halfvec_index_and_searches(env, clean_db, tmp_path):
    """Before: the HNSW build on vector(3072) failed with an uncaught internal error and `embed` never exited."""
    corpus = tmp_path / "big"
    write_corpus(corpus, 6)
    with FakeOpenAI(dim=3072) as big:
        env = {**env, "OPENAI_BASE_URL": big.base_url}
        summary = json.loads(cli("embed", str(corpus), "--json", env=env, timeout=120).stdout)
        assert summary["coverage"] == "6/6"
        valid, indexdef = index_row(clean_db, MODEL_ID)
        assert valid and "halfvec(3072)" in indexdef and "halfvec_cosine_ops" in indexdef
        assert uses_index(clean_db, MODEL_ID, 3072)
        [listed] = json.loads(cli("models", "list", "--json", env=env).stdout)
        assert (listed["dimension"], listed["index"]) == (3072, "ready")
        assert "hnsw halfvec" in cli("models", "list", env=env).stdout
        assert json.loads(cli("status", "--json", env=env).stdout)["vector_index"] == {MODEL_ID: "hnsw halfvec"}
        text = clean_db.execute(
            "SELECT text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = 'doc0003.md'"
        ).fetchone()[0]
        hits = json.loads(cli("search", text, "-k", "3", "--mode", "vector", "--json", env=env).stdout)
    assert hits[0]["document_id"] == "doc0003.md" and hits[0]["distance"] == pytest.approx(0, abs=1e-5)
    assert len(hits) == 3 and hits[0]["distance"] < hits[1]["distance"]


def test_embed_with_4100_dimensions_has_no_index_and_searches_exactly(env, clean_db, tmp_path):
    corpus = tmp_path / "huge"
    write_corpus(corpus, 5)
    with FakeOpenAI(dim=4100) as huge:
        env = {**env, "OPENAI_BASE_URL": huge.base_url}
        summary = json.loads(cli("embed", str(corpus), "--json", env=env, timeout=120).stdout)
        assert summary["coverage"] == "5/5"
        assert index_row(clean_db, MODEL_ID) is None
        [listed] = json.loads(cli("models", "list", "--json", env=env).stdout)
        assert (listed["dimension"], listed["index"]) == (4100, "exact")
        assert "exact search (no index over 4000 dimensions)" in listed["index_detail"]
        assert f"vector index {MODEL_ID}: exact search (no index over 4000 dimensions)" in cli("status", env=env).stdout
        assert (
            cli("models", "index", FAKE_MODEL, env=env)
            .stdout.strip()
            .endswith("index exact search (no index over 4000 dimensions)")
        )
        text = clean_db.execute(
            "SELECT text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = 'doc0001.md'"
        ).fetchone()[0]
        hits = json.loads(cli("search", text, "-k", "5", "--mode", "vector", "--json", env=env).stdout)
    assert next(h["document_id"] for h in hits) == "doc0001.md" and len(hits) == 5
    assert hits[0]["distance"] == pytest.approx(0, abs=1e-6)
    assert [h["distance"] for h in hits] == sorted(h["distance"] for h in hits)


def test_a_failing_index_build_is_a_warning_for_the_worker_and_one_line_for_models_index(env, clean_db, tmp_path):
    """A vector out of halfvec's range makes the build fail: the worker logs it and exits 0 with
    every job ready; `models index` says it in one line; no INVALID index is left behind."""
    corpus = tmp_path / "bad"
    write_corpus(corpus, 3)
    with FakeOpenAI(dim=2500) as fake:
        env = {**env, "OPENAI_BASE_URL": fake.base_url}
        cli("ingest", str(corpus), env=env)
        poison = np.full(2500, 1e6, dtype=np.float32)
        clean_db.execute("UPDATE app.models SET dimension = 2500")
        clean_db.execute(
            "INSERT INTO app.embeddings (chunk_checksum, model_id, embedding) VALUES (%s, %s, %s)",
            (b"orphan", MODEL_ID, poison),
        )
        proc = cli("-v", "work", "--until-idle", env=env, timeout=120)
        assert "could not build the vector index" in proc.stderr and "Traceback" not in proc.stderr
        assert clean_db.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0] == 3
        assert index_row(clean_db, MODEL_ID) is None  # the failed build's INVALID index was dropped
        bad = cli("models", "index", FAKE_MODEL, env=env, check=False)
        assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1, bad.stderr
        assert bad.stderr.startswith("error: could not build the vector index") and "halfvec" in bad.stderr
        clean_db.execute("DELETE FROM app.embeddings WHERE chunk_checksum = 'orphan'")
        assert cli("models", "index", FAKE_MODEL, env=env).stdout.strip() == f"{MODEL_ID}: index hnsw halfvec"
    assert index_row(clean_db, MODEL_ID)[0] is True


# --------------------------------------------------------------------------- concurrency


def test_a_completion_commits_while_the_index_builds(clean_db, database_url, blocker):
    """The build waits behind an open writer; meanwhile a completion takes its lock and commits
    at once. Before: CREATE INDEX (not CONCURRENTLY) queued a SHARE lock that every completion
    then waited behind, for the whole build."""
    conn = clean_db
    rng = np.random.default_rng(1)
    s = spec(8)
    seed_ready(conn, s, [unit(rng, 8) for _ in range(20)])
    seed_pending(conn, s, 1)
    hold_write_lock(blocker)
    outcome: dict = {}
    build_conn = db.connect(database_url)
    t = threading.Thread(target=lambda: outcome.setdefault("state", vector_index.build(build_conn, s.model_id, 8)))
    t.start()
    try:
        pid: dict = {}
        wait_until(lambda: builder_waiting(conn, pid), timeout=60, what="the build to wait for the writer")
        assert vector_index.state(conn, s.model_id, 8) == vector_index.BUILDING
        with db.connect(database_url) as worker:
            # The build waits behind the blocker until the test ends it: a completion that waited
            # for the build would wait forever, and fails at this lock timeout instead.
            worker.execute("SET lock_timeout = '20s'")
            [job] = transitions.claim(worker, model_id=s.model_id, owner="w", limit=1, lease_seconds=60)
            ready, _ = job_helpers.complete(worker, owner="w", job_ids=[job.job_id], vectors=[unit(rng, 8)])
        assert ready == [job.job_id]
        assert t.is_alive()  # the build was still running when the completion committed
        # A second builder does not wait for the first: it leaves the build to it.
        with db.connect(database_url) as other:
            assert vector_index.build(other, s.model_id, 8) == vector_index.BUILDING
    finally:
        blocker.execute("COMMIT")
        t.join(30)
        build_conn.close()
    assert outcome["state"] == vector_index.READY and index_row(conn, s.model_id)[0] is True


def seed_pending(conn, s: ModelSpec, n: int) -> str:
    """A document with n chunks whose jobs are pending (claimable) for model s."""
    source_id = conn.execute("SELECT source_id FROM app.sources WHERE root = '/vi'").fetchone()[0]
    doc = f"p-{uuid.uuid4().hex[:6]}"
    doc_pk = conn.execute(
        "INSERT INTO app.documents (source_id, document_id, source_uri, status, source_checksum)"
        " VALUES (%s, %s, %s, 'current', %s) RETURNING doc_pk",
        (source_id, doc, f"file:///{doc}", b"\x02"),
    ).fetchone()[0]
    for i in range(n):
        t = f"{doc} pending {i}"
        conn.execute(
            "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start,"
            " char_end) VALUES (%s, %s, %s, %s, 3, 0, 10)",
            (doc_pk, i, hashlib.sha256(t.encode()).digest(), t),
        )
    transitions.enqueue_for_docs(conn, [doc_pk], 3)
    return doc


def test_an_invalid_index_left_by_a_failed_build_is_dropped_and_rebuilt(clean_db, database_url):
    conn = clean_db
    rng = np.random.default_rng(2)
    s = spec(2100)
    seed_ready(conn, s, [unit(rng, 2100) for _ in range(5)])
    conn.execute(
        "INSERT INTO app.embeddings (chunk_checksum, model_id, embedding) VALUES ('x', %s, %s)",
        (s.model_id, np.full(2100, 1e6, dtype=np.float32)),
    )
    name = vector_index.index_name(s.model_id)
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):  # a builder that died mid-way, no clean-up
        conn.execute(
            sql.SQL(models.MODELS.create_hnsw_index).format(
                name=sql.Identifier(name),
                kind=sql.Identifier("halfvec"),
                opclass=sql.Identifier("halfvec_cosine_ops"),
                dim=sql.Literal(2100),
                model=sql.Literal(s.model_id),
            )
        )
    assert index_row(conn, s.model_id)[0] is False
    assert vector_index.state(conn, s.model_id, 2100) == vector_index.INVALID
    conn.execute("DELETE FROM app.embeddings WHERE chunk_checksum = 'x'")
    assert vector_index.build(conn, s.model_id, 2100) == vector_index.READY
    valid, indexdef = index_row(conn, s.model_id)
    assert valid and "halfvec(2100)" in indexdef
    assert vector_index.build(conn, s.model_id, 2100) == vector_index.READY  # idempotent


def test_a_build_uses_its_own_memory_and_leaves_the_session_as_it_was(clean_db, monkeypatch):
    conn = clean_db
    rng = np.random.default_rng(3)
    s = spec(8)
    seed_ready(conn, s, [unit(rng, 8) for _ in range(5)])
    server_default = conn.execute("SHOW maintenance_work_mem").fetchone()[0]
    # The build sets its memory: a value the server refuses fails the build (one line)...
    monkeypatch.setattr(index_memory, "GRAPH_MEMORY_FIXED", 1 << 45)  # 32 TiB: over the server's maximum
    with pytest.raises(vector_index.IndexBuildError, match="maintenance_work_mem"):
        vector_index.build(conn, s.model_id, 8, memory_cap=1 << 46)
    assert index_row(conn, s.model_id) is None
    # ...unless the refusal is one the build falls back from: then it builds with the server's setting.
    monkeypatch.setattr(vector_index, "OUT_OF_BUILD_MEMORY", ("22023",))  # invalid_parameter_value
    assert vector_index.build(conn, s.model_id, 8, memory_cap=1 << 46) == vector_index.READY
    assert index_row(conn, s.model_id)[0] is True
    assert conn.execute("SHOW maintenance_work_mem").fetchone()[0] == server_default


def test_a_build_refuses_to_run_inside_a_transaction(clean_db):
    with clean_db.transaction(), pytest.raises(ValueError, match="outside any transaction"):
        vector_index.build(clean_db, "test/vi@8", 8)


def test_a_cancelled_background_build_leaves_an_index_the_next_build_replaces(clean_db, database_url, blocker):
    """What a worker stopped during its build leaves behind, and the next drain repairs."""
    conn = clean_db
    s = spec(8, "cancel")
    seed_ready(conn, s, [unit(np.random.default_rng(3), 8) for _ in range(4)])
    hold_write_lock(blocker)
    try:
        build = background_build.BackgroundBuild(lambda: db.connect(database_url), s.model_id, 8).start()
        wait_until(lambda: builder_waiting(conn, {}), timeout=60, what="the build to wait")
        build.cancel()
        assert build.done and build.outcome is None
    finally:
        blocker.execute("COMMIT")
    assert vector_index.state(conn, s.model_id, 8) == vector_index.INVALID
    again = background_build.BackgroundBuild(lambda: db.connect(database_url), s.model_id, 8).start()
    wait_until(lambda: again.done, timeout=30, what="the rebuild")
    assert again.outcome == vector_index.READY and again.error is None
    assert index_row(conn, s.model_id)[0] is True


def test_a_worker_stays_responsive_while_its_index_builds(env, clean_db, database_url, blocker, tmp_path):
    """The drain's build runs beside the worker's main loop: `--until-idle` waits for it, a stop
    signal cancels it at once, and the next drain drops the INVALID leftover and builds again."""
    corpus = tmp_path / "w"
    write_corpus(corpus, 4)
    cli("ingest", str(corpus), env=env)
    rt = Runtime.build(Settings.from_env())
    hold_write_lock(blocker)
    stop = threading.Event()
    worker = Worker(
        database_url,
        rt.provider,
        rt.settings.worker_config(concurrency=2, until_idle=True, poll_seconds=0.05),
        stop_event=stop,
    )
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("report", worker.run()))
    thread.start()
    try:
        wait_until(lambda: builder_waiting(clean_db, {}), timeout=30, what="the drain's build")
        assert clean_db.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0] == 4
        time.sleep(0.5)  # (a chance to exit wrongly: the check cannot fail on a slow machine)
        assert thread.is_alive()  # --until-idle waits for its build (blocked until the test commits)...
        stop.set()  # ...but a stop signal does not: the build would never end by itself
        thread.join(60)
        assert not thread.is_alive()
    finally:
        blocker.execute("COMMIT")
        stop.set()
        thread.join(10)
    assert result["report"].embedded == 4
    assert vector_index.state(clean_db, MODEL_ID, 16) == vector_index.INVALID
    cli("work", "--until-idle", env=env)
    assert index_row(clean_db, MODEL_ID)[0] is True


def test_reconcile_neither_builds_nor_waits_for_a_build(clean_db, database_url, blocker):
    conn = clean_db
    s = spec(8, "rec")
    seed_ready(conn, s, [unit(np.random.default_rng(4), 8) for _ in range(4)])
    options = IngestOptions(chunker=chunker_for(Settings.from_env()), config=IngestConfig(max_bytes=1 << 20))
    reconcile(conn, options, model_id=s.model_id, rescan=False)
    assert vector_index.state(conn, s.model_id, 8) == vector_index.MISSING  # left to a worker's drain
    hold_write_lock(blocker)
    build = background_build.BackgroundBuild(lambda: db.connect(database_url), s.model_id, 8).start()
    try:
        wait_until(lambda: builder_waiting(conn, {}), timeout=60, what="the build to wait")
        with db.connect(database_url) as rc:
            rc.execute("SET lock_timeout = '20s'")  # waiting for the (blocked) build would fail here
            reconcile(rc, options, model_id=s.model_id, rescan=False)
        assert not build.done
    finally:
        blocker.execute("COMMIT")
    wait_until(lambda: build.done, timeout=30, what="the build")
    assert build.outcome == vector_index.READY


# --------------------------------------------------------------------------- search without an index


@pytest.mark.parametrize("dim", [8, 2100])
def test_search_is_exact_before_the_index_exists_and_uses_it_after(clean_db, dim):
    conn = clean_db
    rng = np.random.default_rng(dim)
    s = spec(dim, f"s{dim}")
    vectors = [unit(rng, dim) for _ in range(30)]
    texts = seed_ready(conn, s, vectors)
    query = vectors[7] + 0.05 * unit(rng, dim)
    exact = sorted(range(30), key=lambda i: 1 - float(np.dot(vectors[i], query) / np.linalg.norm(query)))
    assert vector_index.state(conn, s.model_id, dim) == vector_index.MISSING
    hits = search_uc.nearest(conn, s.model_id, query, k=5)
    assert [h["text"] for h in hits] == [texts[i] for i in exact[:5]]
    assert vector_index.build(conn, s.model_id, dim) == vector_index.READY
    assert uses_index(conn, s.model_id, dim)
    hits = search_uc.nearest(conn, s.model_id, query, k=3)
    assert hits[0]["text"] == texts[7]
    assert [h["distance"] for h in hits] == sorted(h["distance"] for h in hits)


# --------------------------------------------------------------------------- at scale


def seed_vectors(conn, s: ModelSpec, n: int) -> None:
    """n random unit vectors of model s straight into app.embeddings (binary COPY: no chunks)."""
    models.ensure_model(conn, s)
    block = np.random.default_rng(n).standard_normal((n, s.dimension)).astype(np.float32)
    block /= np.linalg.norm(block, axis=1, keepdims=True)
    with conn.cursor().copy(
        "COPY app.embeddings (chunk_checksum, model_id, embedding) FROM STDIN WITH (FORMAT BINARY)"
    ) as cp:
        cp.set_types(["bytea", "text", "vector"])
        for i, v in enumerate(block):
            cp.write_row((hashlib.sha256(f"{s.model_id}/{i}".encode()).digest(), s.model_id, v))


def index_identity(conn, model_id: str):
    """(oid, relfilenode) of the model's index: both change when it is rebuilt."""
    return conn.execute(
        "SELECT c.oid, c.relfilenode FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'app' AND c.relname = %s",
        (vector_index.index_name(model_id),),
    ).fetchone()


def test_build_memory_follows_the_graph_within_the_cap_and_never_below_the_session():
    mb, gib = 1 << 20, 1 << 30
    # 1M vectors of 256 dimensions: ~1.9 GB of graph (720 + 4 x 256 bytes each, 10% margin).
    assert index_memory.graph_bytes(1_000_000, 256, "vector") == pytest.approx(1.93e9, rel=0.01)
    assert index_memory.build_memory(
        1_000_000, 256, "vector", session_memory=64 * mb, cap=2 * gib
    ) == index_memory.graph_bytes(1_000_000, 256, "vector")
    assert index_memory.build_memory(1_000_000, 256, "vector", session_memory=64 * mb, cap=gib) == gib  # capped
    assert index_memory.build_memory(1_000, 256, "vector", session_memory=64 * mb, cap=gib) == 64 * mb  # the server's
    assert index_memory.build_memory(10**6, 256, "vector", session_memory=4 * gib, cap=gib) == 4 * gib  # not lowered
    # halfvec halves the vector's part.
    assert index_memory.graph_bytes(10**6, 3072, "halfvec") < index_memory.graph_bytes(10**6, 2000, "vector") * 1.3


def test_a_build_is_given_the_memory_of_its_graph_up_to_the_cap(clean_db):
    """With a session holding 1 MB, a build sized from its vectors keeps its ~3 MB graph in memory;
    capped at 1 MB it spills (pgvector says so), and either way the session keeps its own setting.
    A fixed size would waste memory on a small graph and spill a large one (1M vectors) to disk."""
    conn = clean_db
    s = spec(64, "mem")
    seed_vectors(conn, s, 3000)  # ~3 MB of graph: (720 + 4 x 64) bytes each
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("SET maintenance_work_mem = '1MB'")
    assert vector_index.build(conn, s.model_id, 64, memory_cap=1 << 20) == vector_index.READY
    assert any("no longer fits into maintenance_work_mem" in n for n in notices), notices
    conn.execute(f'DROP INDEX app."{vector_index.index_name(s.model_id)}"')
    notices.clear()
    assert vector_index.build(conn, s.model_id, 64, memory_cap=64 << 20) == vector_index.READY
    assert not any("no longer fits" in n for n in notices), notices
    assert index_row(conn, s.model_id)[0] is True
    assert conn.execute("SHOW maintenance_work_mem").fetchone()[0] == "1MB"


def test_search_answers_and_status_shows_progress_while_the_index_builds(env, clean_db, database_url, blocker):
    """A build held by open writers (before its build, then before its validation): search
    answers exactly meanwhile, and `status` shows the build's phase from pg_stat_progress_create_index."""
    conn = clean_db
    rng = np.random.default_rng(5)
    s = spec(8, "held")
    vectors = [unit(rng, 8) for _ in range(30)]
    texts = seed_ready(conn, s, vectors)
    query = vectors[11] + 0.05 * unit(rng, 8)
    hold_write_lock(blocker)
    build = background_build.BackgroundBuild(lambda: db.connect(database_url), s.model_id, 8).start()
    late = db.connect(database_url)
    try:
        wait_until(lambda: builder_waiting(conn, {}), timeout=60, what="the build to wait for the writer")
        hits = search_uc.nearest(conn, s.model_id, query, k=3)
        assert hits[0]["text"] == texts[11] and len(hits) == 3
        report = json.loads(cli("status", "--json", env=env).stdout)
        assert report["vector_index_builds"][s.model_id]["phase"] == "waiting for writers before build"
        assert report["vector_index"][s.model_id].startswith(
            "hnsw vector building (exact search meanwhile): waiting for writers before build"
        )
        hold_write_lock(late)  # a writer the build's validation will wait for
        blocker.execute("COMMIT")
        wait_until(
            lambda: (
                (vector_index.progress(conn, s.model_id) or {}).get("phase") == "waiting for writers before validation"
            ),
            timeout=60,
            what="the build to reach validation",
        )
        p = vector_index.progress(conn, s.model_id)
        assert all(isinstance(p[k], int) for k in ("blocks_done", "blocks_total", "tuples_done", "tuples_total"))
        assert index_row(conn, s.model_id)[0] is False  # built, not yet valid: search still scans
        hits = search_uc.nearest(conn, s.model_id, query, k=3)
        assert hits[0]["text"] == texts[11] and len(hits) == 3
        assert "waiting for writers before validation" in cli("status", env=env).stdout
    finally:
        for c in (blocker, late):
            if c.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                c.execute("COMMIT")
        late.close()
    wait_until(lambda: build.done, timeout=60, what="the build")
    assert build.outcome == vector_index.READY
    assert json.loads(cli("status", "--json", env=env).stdout)["vector_index_builds"] == {}
    assert search_uc.nearest(conn, s.model_id, query, k=3)[0]["text"] == texts[11]


def test_a_second_run_keeps_the_index_and_inserts_maintain_it(env, clean_db, tmp_path):
    """The index is built once, when a queue first drains; later runs insert into it."""
    corpus = tmp_path / "again"
    write_corpus(corpus, 4)
    cli("embed", str(corpus), env=env)
    first = index_identity(clean_db, MODEL_ID)
    assert first is not None and index_row(clean_db, MODEL_ID)[0] is True
    write_corpus(corpus, 8, prefix="more")
    cli("embed", str(corpus), env=env)
    cli("work", "--until-idle", env=env)
    assert index_identity(clean_db, MODEL_ID) == first  # neither rebuilt nor replaced
    assert clean_db.execute("SELECT count(*) FROM app.embeddings").fetchone()[0] == 12
    assert uses_index(clean_db, MODEL_ID, 16)
    text = clean_db.execute(
        "SELECT text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = 'more0005.md'"
    ).fetchone()[0]
    hits = json.loads(cli("search", text, "-k", "1", "--mode", "vector", "--json", env=env).stdout)
    assert hits[0]["document_id"] == "more0005.md"  # a vector inserted after the build, found through it


def test_a_build_whose_backend_is_killed_is_rebuilt_by_the_next_run(env, clean_db, database_url, blocker, tmp_path):
    """`models index` killed mid-build (its process SIGKILLed, its backend terminated) leaves an
    INVALID index; `status` says so and the next drain drops it and builds a valid one."""
    corpus = tmp_path / "k"
    write_corpus(corpus, 4)
    cli("ingest", str(corpus), env=env)
    cli("work", "--until-idle", env=env)
    clean_db.execute(f'DROP INDEX app."{vector_index.index_name(MODEL_ID)}"')
    hold_write_lock(blocker)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline_assets.cli", "models", "index", FAKE_MODEL],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        pid: dict = {}
        wait_until(lambda: builder_waiting(clean_db, pid), timeout=120, what="the build to wait for the writer")
        killed = index_identity(clean_db, MODEL_ID)
        os.killpg(proc.pid, signal.SIGKILL)
        clean_db.execute("SELECT pg_terminate_backend(%s)", (pid["pid"],))
        wait_until(lambda: not builder_waiting(clean_db, {}), timeout=60, what="the backend to end")
    finally:
        proc.wait(30)
        blocker.execute("COMMIT")
    assert vector_index.state(clean_db, MODEL_ID, 16) == vector_index.INVALID
    assert "invalid" in json.loads(cli("status", "--json", env=env).stdout)["vector_index"][MODEL_ID]
    cli("work", "--until-idle", env=env)
    assert index_row(clean_db, MODEL_ID)[0] is True
    assert index_identity(clean_db, MODEL_ID)[0] != killed[0]
    assert uses_index(clean_db, MODEL_ID, 16)


def test_through_a_transaction_pooler_the_build_is_left_to_a_session(env, clean_db, tmp_path):
    """PIPELINE_DATABASE_POOL_MODE=transaction: the build's advisory lock and memory setting are a
    session's, and through a transaction pooler each statement may land on another server
    connection (the lock stays held there, the setting leaks to another client). So `embed` and
    `work` send no statement of a build; `models index` says in one line to run it on a session;
    a session's build is then kept by the pooled workers."""
    clean_db.execute(f'DROP INDEX IF EXISTS app."{vector_index.index_name(MODEL_ID)}"')
    pooled = {**env, "PIPELINE_DATABASE_POOL_MODE": "transaction"}
    corpus = tmp_path / "p"
    write_corpus(corpus, 4)
    cli("embed", str(corpus), env=pooled)
    assert index_row(clean_db, MODEL_ID) is None
    refused = cli("models", "index", FAKE_MODEL, env=pooled, check=False)
    assert refused.returncode != 0
    assert refused.stderr.strip().startswith("error:") and len(refused.stderr.strip().splitlines()) == 1
    assert "session" in refused.stderr
    assert index_row(clean_db, MODEL_ID) is None
    cli("models", "index", FAKE_MODEL, env=env)
    built = index_identity(clean_db, MODEL_ID)
    assert index_row(clean_db, MODEL_ID)[0] is True
    write_corpus(tmp_path / "q", 2)
    cli("embed", str(tmp_path / "q"), env=pooled)
    assert index_identity(clean_db, MODEL_ID) == built
