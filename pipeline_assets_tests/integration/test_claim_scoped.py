"""The scoped claim (sql/queries/jobs.sql: claim_scoped) a Dagster embeddings run's worker uses:
only the jobs of some documents' chunks, under the same breaker gate and probe slot as claim."""

from __future__ import annotations

import pytest

from pipeline_assets.app.ingest import ingest_source
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.jobqueue.pg_job_store import PostgresJobStore
from pipeline_assets.settings import Settings
from pipeline_assets.store import db
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import write_corpus

LEASE = 30.0


@pytest.fixture
def pool(env, clean_db, database_url):
    p = db.make_pool(database_url, max_size=4)
    yield p
    p.close()


@pytest.fixture
def docs(pool, tmp_path) -> tuple[str, dict[str, int]]:
    """Three ingested documents (jobs pending): the model id and each document's doc_pk."""
    root = tmp_path / "src"
    write_corpus(root, 3, words=900)  # a few chunks each
    rt = Runtime.build(Settings.from_env(), FAKE_MODEL)
    ingest_source(rt, pool, root)
    with pool.connection() as conn:
        pks = dict(conn.execute("SELECT document_id, doc_pk FROM app.documents").fetchall())
    return rt.model_id, pks


def _store(pool, model_id: str, scope: list[int]) -> PostgresJobStore:
    return PostgresJobStore(pool, model_id=model_id, worker_id="w", backoff_base=0.05, backoff_cap=0.2, scope=scope)


def _doc_of_jobs(conn, job_ids: list[int]) -> set[str]:
    return {
        r[0]
        for r in conn.execute(
            """SELECT DISTINCT d.document_id FROM app.embedding_jobs j JOIN app.chunks c USING (chunk_checksum)
           JOIN app.documents d USING (doc_pk) WHERE j.job_id = ANY(%s)""",
            (job_ids,),
        )
    }


def test_claims_only_the_scopes_jobs(pool, docs, conn):
    model_id, pks = docs
    store = _store(pool, model_id, [pks["doc0001.md"]])
    jobs = store.claim(owner="w/1", limit=100, lease_seconds=LEASE)
    assert jobs and _doc_of_jobs(conn, [j.job_id for j in jobs]) == {"doc0001.md"}
    assert all(j.text and j.attempts == 1 and not j.probe for j in jobs)
    own = conn.execute("SELECT count(*) FROM app.chunks WHERE doc_pk = %s", (pks["doc0001.md"],)).fetchone()[0]
    assert len(jobs) == own
    assert store.claim(owner="w/2", limit=100, lease_seconds=LEASE) == []  # nothing left in scope
    counts = dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall())
    assert counts["processing"] == own and counts["pending"] > 0  # the others still wait
    assert _store(pool, model_id, []).claim(owner="w/3", limit=10, lease_seconds=LEASE) == []  # empty scope


def test_the_breaker_gates_the_scoped_claim_like_claim(pool, docs, conn):
    model_id, pks = docs
    store = _store(pool, model_id, [pks["doc0000.md"]])
    conn.execute(
        """INSERT INTO app.provider_state (model_id, consecutive_failures, tripped, paused_until)
                    VALUES (%s, 5, true, now() + interval '1 hour')""",
        (model_id,),
    )
    assert store.claim(owner="w/1", limit=100, lease_seconds=LEASE) == []  # paused: nobody claims
    conn.execute(
        "UPDATE app.provider_state SET paused_until = now() - interval '1 second' WHERE model_id = %s", (model_id,)
    )
    probe = store.claim(owner="w/2", limit=100, lease_seconds=LEASE)  # half-open: one probe claim
    assert probe and all(j.probe for j in probe)
    assert conn.execute("SELECT probe_owner FROM app.provider_state").fetchone()[0] == "w/2"
    other = _store(pool, model_id, [pks["doc0002.md"]])
    assert other.claim(owner="w/3", limit=100, lease_seconds=LEASE) == []  # the slot is taken
    store.release_probe("w/2")
    # A scope with nothing waiting does not take the slot, though other documents' jobs wait.
    assert store.claim(owner="w/4", limit=100, lease_seconds=LEASE) == []
    assert conn.execute("SELECT probe_owner FROM app.provider_state").fetchone()[0] is None
    assert other.claim(owner="w/5", limit=100, lease_seconds=LEASE)  # the next probe goes out


def test_a_give_back_the_lease_fence_refuses_is_counted_as_refused(pool, docs, conn):
    """A worker that lost its lease (another claimed the jobs) and stops: its give-back changes
    nothing, and its report says how many it could not hand back."""
    from pipeline_assets.jobqueue.report import ReportCounts, WorkerReport

    model_id, pks = docs
    report = WorkerReport()
    late = PostgresJobStore(
        pool,
        model_id=model_id,
        worker_id="late",
        backoff_base=0.05,
        backoff_cap=0.2,
        scope=[pks["doc0000.md"]],
        observers=[ReportCounts(report)],
    )
    held = [j.job_id for j in late.claim(owner="late/1", limit=100, lease_seconds=LEASE)]
    assert held
    conn.execute(
        "UPDATE app.embedding_jobs SET lease_expires_at = now() - interval '1 second' WHERE job_id = ANY(%s)", (held,)
    )
    assert _store(pool, model_id, [pks["doc0000.md"]]).rescue() == len(held)
    conn.execute("UPDATE app.embedding_jobs SET available_at = now() WHERE job_id = ANY(%s)", (held,))
    taken = _store(pool, model_id, [pks["doc0000.md"]]).claim(owner="other/1", limit=100, lease_seconds=LEASE)
    assert sorted(j.job_id for j in taken) == sorted(held)
    late.give_back_all([("late/1", held)])
    assert report.refused == len(held)
    owners = {r[0] for r in conn.execute("SELECT lease_owner FROM app.embedding_jobs WHERE job_id = ANY(%s)", (held,))}
    assert owners == {"other/1"}  # the give-back took nothing from the new holder
