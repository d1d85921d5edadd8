"""Asset checks: coverage per bucket of the run (ERROR); store health on the schedule only."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app.ingest import ingest_documents
from pipeline_assets.defs.embeddings.checks import COVERAGE_CHECK
from pipeline_assets.defs.keys import EMBEDDINGS
from pipeline_assets.defs.partitions import bucket_key, embedding_key, split_key
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.settings import Settings
from pipeline_assets.store import reports
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.dagster_helpers import (
    bucket_of,
    check_results,
    execute,
    fresh_defs,
    range_tags,
    watched_corpus,
)
from pipeline_assets_tests.data_helpers import job_counts

KEYS = [f"doc{i:04d}.md" for i in range(12)]
MODEL = f"openai/{FAKE_MODEL}"
# A run over the buckets b033..b041: doc0008 and doc0011 share b033, doc0000 is alone in b041, and every
# other document of the corpus lies outside the range (asserted below, since the buckets are a hash).
PAIR, SINGLE = ["doc0008.md", "doc0011.md"], "doc0000.md"
RUN = [bucket_key(i) for i in range(33, 42)]


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    return watched_corpus(tmp_path / "corpus", len(KEYS), monkeypatch)


def _coverage_only(defs: dg.Definitions, instance: dg.DagsterInstance, key: str) -> dg.AssetCheckEvaluation:
    """The coverage check alone for one bucket (x the model), as 'Execute check' in the UI runs it."""
    job = defs.resolve_job_def("embed_documents").get_subset(
        asset_selection=set(), asset_check_selection={dg.AssetCheckKey(EMBEDDINGS, COVERAGE_CHECK)}
    )
    partition = str(embedding_key(key, MODEL))
    result = job.execute_in_process(instance=instance, partition_key=partition, raise_on_error=False)
    assert result.success
    (evaluation,) = result.get_asset_check_evaluations()
    assert evaluation.partition == partition and evaluation.severity == dg.AssetCheckSeverity.ERROR
    return evaluation


def _health(defs, instance) -> dict[str, dg.AssetCheckEvaluation]:
    result = execute(defs, instance, job="pipeline_health")
    assert result.success
    return check_results(result)


def _chunks(conn, root, docs) -> int:
    summaries = reports.document_summaries(conn, str(root), docs)
    return sum(summaries[d].chunks for d in docs)


def test_coverage_is_per_bucket_and_a_backlog_elsewhere_does_not_fail_it(corpus, conn, fake):
    assert {bucket_of(d) for d in PAIR} == {RUN[0]} and bucket_of(SINGLE) == RUN[-1]
    others = [d for d in KEYS if d not in (*PAIR, SINGLE)]
    assert not {bucket_of(d) for d in others} & set(RUN)
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    result = execute(defs, instance, tags=range_tags(RUN))
    assert result.success
    evaluations = {bucket_key(split_key(e.partition)[0]): e for e in result.get_asset_check_evaluations()}
    assert {split_key(e.partition)[1] for e in evaluations.values()} == {MODEL}
    # One ERROR-severity evaluation per bucket of the run (empty ones included), none per document, and
    # only the coverage check runs.
    assert sorted(evaluations) == RUN
    assert all(e.check_name == COVERAGE_CHECK and e.passed for e in evaluations.values())
    assert all(e.severity == dg.AssetCheckSeverity.ERROR for e in evaluations.values())
    root = corpus.resolve()
    pair = {k: v.value for k, v in evaluations[RUN[0]].metadata.items()}
    # The shared bucket's evaluation sums both its documents' chunks.
    assert pair["chunks"] == pair["ready"] == _chunks(conn, root, PAIR) > _chunks(conn, root, PAIR[:1])
    assert pair["failed"] == pair["waiting"] == 0 and pair["model"] == MODEL
    assert evaluations[RUN[-1]].metadata["ready"].value == _chunks(conn, root, [SINGLE]) > 0
    assert all(evaluations[k].metadata["chunks"].value == 0 for k in RUN[1:-1])
    # The run ingested its buckets' documents, nothing else.
    assert sorted(reports.document_summaries(conn, str(root), KEYS)) == sorted([*PAIR, SINGLE])

    # A backfill in progress elsewhere: the other documents are ingested, their jobs still pending.
    settings = Settings.from_env()
    with dg.build_resources(build_resources(settings)) as res:
        ingest_documents(res.embedding_provider.runtime(), res.postgres.pool(), root, others)
    assert job_counts(conn)["pending"] > 0
    assert _coverage_only(defs, instance, RUN[-1]).passed  # its own chunks are embedded
    waiting = _coverage_only(defs, instance, bucket_of(others[0]))  # not reached yet: says so
    assert not waiting.passed and waiting.metadata["waiting"].value == waiting.metadata["chunks"].value > 0
    assert waiting.metadata["chunks"].value == _chunks(
        conn, root, [d for d in others if bucket_of(d) == bucket_of(others[0])]
    )
    assert all(c.passed for c in _health(defs, instance).values())  # pending work is not unhealthy

    # A dead-lettered job fails exactly the bucket whose chunk it is, and names the document.
    conn.execute(
        """UPDATE app.embedding_jobs SET status = 'failed', error_class = 'bad_input'
                    WHERE job_id = (SELECT j.job_id FROM app.embedding_jobs j
                                    JOIN app.chunks c ON c.chunk_checksum = j.chunk_checksum
                                    JOIN app.documents d ON d.doc_pk = c.doc_pk
                                    WHERE d.document_id = %s AND j.status = 'ready' LIMIT 1)""",
        (PAIR[1],),
    )
    failed = _coverage_only(defs, instance, RUN[0])
    assert not failed.passed and failed.metadata["failed"].value == 1
    assert failed.metadata["failed_ids"].value == PAIR[1]
    assert "see `pipeline-assets dlq list`" in failed.description
    assert _coverage_only(defs, instance, RUN[-1]).passed


def test_store_health_checks_run_on_the_schedule_not_in_embedding_runs(corpus, conn, fake, monkeypatch):
    defs = fresh_defs()
    repo = defs.get_repository_def()
    # The schedule's job selects the store's checks alone; the embedding job never runs them.
    schedule = repo.get_schedule_def("pipeline_health_checks")
    assert schedule.job_name == "pipeline_health"
    health_checks = {
        k.name
        for k in repo.get_job("pipeline_health").asset_layer.asset_graph.asset_check_keys
        if k.asset_key == dg.AssetKey("embedding_store")
    }
    assert health_checks == {"no_stale_vector_current", "dead_letter_growth"}
    instance = dg.DagsterInstance.ephemeral()
    run = execute(defs, instance, partition_key=bucket_of(KEYS[0]))
    assert run.success and {e.check_name for e in run.get_asset_check_evaluations()} == {COVERAGE_CHECK}
    assert execute(defs, instance, partition_key=bucket_of(KEYS[1])).success
    checks = _health(defs, instance)
    assert {n: c.passed for n, c in checks.items()} == {"no_stale_vector_current": True, "dead_letter_growth": True}

    # A stale vector: the job was superseded but its vector is still stored. ERROR.
    conn.execute(
        "UPDATE app.embedding_jobs SET status = 'superseded'"
        " WHERE job_id = (SELECT min(job_id) FROM app.embedding_jobs WHERE status = 'ready')"
    )
    checks = _health(defs, instance)
    stale = checks["no_stale_vector_current"]
    assert not stale.passed and stale.severity == dg.AssetCheckSeverity.ERROR
    assert stale.metadata["vectors_without_ready_job"].value == 1
    assert checks["dead_letter_growth"].passed
    conn.execute("UPDATE app.embedding_jobs SET status = 'ready' WHERE status = 'superseded'")
    assert all(c.passed for c in _health(defs, instance).values())

    # A dead-letter burst: 25 jobs failed within the hour (threshold 10/h): a WARNING.
    model = conn.execute("SELECT model_id FROM app.models WHERE active").fetchone()[0]
    with conn.transaction():  # a job and its key commit together (deferred foreign keys, sql/009)
        conn.execute(
            """INSERT INTO app.embedding_jobs (chunk_checksum, model_id, status, attempts, error_class)
                        SELECT sha256(('poison' || i)::bytea), %s, 'failed', 5, 'bad_input'
                        FROM generate_series(1, 25) AS i""",
            (model,),
        )
        conn.execute("""INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
                        SELECT chunk_checksum, model_id, job_id FROM app.embedding_jobs
                        WHERE chunk_checksum IN (SELECT sha256(('poison' || i)::bytea)
                                                 FROM generate_series(1, 25) i)""")
    growth = _health(defs, instance)["dead_letter_growth"]
    assert not growth.passed and growth.severity == dg.AssetCheckSeverity.WARN
    assert growth.metadata["failed_last_hour"].value == 25 and growth.metadata["threshold_per_hour"].value == 10
    # A higher threshold from the environment (read when the code location loads) passes the same burst.
    monkeypatch.setenv("PIPELINE_DLQ_GROWTH_PER_HOUR", "30")
    assert not _health(defs, instance)["dead_letter_growth"].passed  # not read again by loaded definitions
    assert _health(fresh_defs(), instance)["dead_letter_growth"].passed
    monkeypatch.delenv("PIPELINE_DLQ_GROWTH_PER_HOUR")
    # Large but not growing (failed hours ago): passes. Depth is not the signal.
    conn.execute("UPDATE app.embedding_jobs SET updated_at = now() - interval '3 hours' WHERE status = 'failed'")
    growth = _health(defs, instance)["dead_letter_growth"]
    assert growth.passed and growth.metadata["failed_total"].value == 25
