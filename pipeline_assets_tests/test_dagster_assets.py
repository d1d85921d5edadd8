"""The assets in-process against real PostgreSQL and the fake OpenAI server, and the asset checks."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app import reports
from pipeline_assets.defs.assets import build_assets
from pipeline_assets.defs.checks import CHECKS
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.settings import Settings
from pipeline_assets_tests.conftest import FAKE_MODEL, write_corpus
from pipeline_assets_tests.dagster_helpers import (check_results, execute, fresh_defs,
                                                   materialization_metadata)


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    write_corpus(root, 4)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    return root


def _materialize(instance, key: str) -> dg.ExecuteInProcessResult:
    return dg.materialize([*build_assets(Settings.from_env()), *CHECKS], partition_key=key, instance=instance,
                          resources=build_resources(Settings.from_env()))


def test_materialize_one_partition_then_again_without_provider_calls(corpus, conn, fake):
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["doc0000.md", "doc0001.md"])

    result = _materialize(instance, "doc0000.md")
    assert result.success
    doc = reports.document_summaries(conn, str(corpus.resolve()), ["doc0000.md"])["doc0000.md"]
    assert doc.status == "current" and doc.chunks >= 1
    # Only the partition's document was ingested.
    assert conn.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 1
    emb = materialization_metadata(result, "embeddings")
    assert emb["embedded"] == doc.chunks and emb["reused"] == 0 and emb["failed"] == 0
    assert emb["provider_calls"] >= 1 and emb["tokens"] > 0 and emb["coverage_ratio"] == 1.0
    assert emb["model"] == f"openai/{FAKE_MODEL}"
    # Data versions: the text checksum and the digest of the chunk checksums, for one partition.
    (docs_event,) = result.asset_materializations_for_node("documents")
    assert docs_event.tags["dagster/data_version"] == doc.text_checksum
    assert docs_event.metadata["text_checksum"].value == doc.text_checksum
    (chunks_event,) = result.asset_materializations_for_node("chunks")
    assert chunks_event.tags["dagster/data_version"] == doc.chunks_digest
    assert chunks_event.tags["dagster/code_version"].startswith("tok-window-1/")
    assert all(c.passed for c in check_results(result).values()), check_results(result)
    billed = fake.stats["billed_inputs"]
    requests = fake.stats["requests"]

    again = _materialize(instance, "doc0000.md")
    assert again.success
    assert fake.stats["requests"] == requests and fake.stats["billed_inputs"] == billed
    emb = materialization_metadata(again, "embeddings")
    assert emb["embedded"] == 0 and emb["provider_calls"] == 0 and emb["reused"] == doc.chunks
    assert materialization_metadata(again, "documents")["unchanged"] == 1
    # Same content, same data versions: nothing downstream looks changed.
    assert again.asset_materializations_for_node("chunks")[0].tags["dagster/data_version"] == doc.chunks_digest


def test_range_run_records_per_partition_checksums(corpus, conn, fake):
    """A multi-partition run is one run; each partition's event carries its own checksum."""
    instance = dg.DagsterInstance.ephemeral()
    keys = [f"doc{i:04d}.md" for i in range(4)]
    instance.add_dynamic_partitions("documents", keys)
    result = execute(fresh_defs(), instance, tags={"dagster/asset_partition_range_start": keys[0],
                                                   "dagster/asset_partition_range_end": keys[-1]})
    assert result.success
    summaries = reports.document_summaries(conn, str(corpus.resolve()), keys)
    events = {e.partition: e for e in result.asset_materializations_for_node("documents")}
    assert set(events) == set(keys)
    for key in keys:
        assert events[key].metadata["text_checksum"].value == summaries[key].text_checksum
    chunk_events = {e.partition: e for e in result.asset_materializations_for_node("chunks")}
    for key in keys:
        assert chunk_events[key].metadata["chunks_digest"].value == summaries[key].chunks_digest
    emb = materialization_metadata(result, "embeddings")
    assert emb["partitions"] == 4 and emb["coverage_ratio"] == 1.0
    assert emb["embedded"] == sum(s.chunks for s in summaries.values())


def test_a_pipe_in_a_partition_key_is_skipped_with_a_clear_log(corpus, conn, fake, caplog):
    (corpus / "bad|name.md").write_text("never ingested")
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["bad|name.md"])
    result = _materialize(instance, "bad|name.md")
    assert result.success
    assert materialization_metadata(result, "documents")["skipped_invalid_keys"] == 1
    assert conn.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 0
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert any("skipping document 'bad|name.md'" in m and "'|'" in m for m in logs)


def _health(defs, instance) -> dict[str, dg.AssetCheckEvaluation]:
    result = execute(defs, instance, job="pipeline_health")
    assert result.success
    return check_results(result)


def test_checks_pass_healthy_and_fail_on_stale_vector_and_dead_letter_burst(corpus, conn, fake, monkeypatch):
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["doc0000.md", "doc0001.md"])
    assert execute(defs, instance, partition_key="doc0000.md").success
    assert execute(defs, instance, partition_key="doc0001.md").success
    checks = _health(defs, instance)
    assert {n: c.passed for n, c in checks.items()} == {
        "current_chunks_have_ready_embeddings": True, "no_stale_vector_current": True,
        "dead_letter_growth": True}

    # A stale vector: the job was superseded but its vector is still stored.
    conn.execute("UPDATE app.embedding_jobs SET status = 'superseded'"
                 " WHERE job_id = (SELECT min(job_id) FROM app.embedding_jobs WHERE status = 'ready')")
    checks = _health(defs, instance)
    assert not checks["no_stale_vector_current"].passed
    assert checks["no_stale_vector_current"].metadata["vectors_without_ready_job"].value == 1
    assert not checks["current_chunks_have_ready_embeddings"].passed
    assert checks["dead_letter_growth"].passed
    conn.execute("UPDATE app.embedding_jobs SET status = 'ready' WHERE status = 'superseded'")
    assert all(c.passed for c in _health(defs, instance).values())

    # A dead-letter burst: 25 jobs failed within the hour (threshold 10/h) -> fails.
    model = conn.execute("SELECT model_id FROM app.models WHERE active").fetchone()[0]
    conn.execute("""INSERT INTO app.embedding_jobs (chunk_checksum, model_id, status, attempts, error_class)
                    SELECT sha256(('poison' || i)::bytea), %s, 'failed', 5, 'bad_input'
                    FROM generate_series(1, 25) AS i""", (model,))
    conn.execute("""INSERT INTO app.job_keys (chunk_checksum, model_id, job_id)
                    SELECT chunk_checksum, model_id, job_id FROM app.embedding_jobs
                    WHERE chunk_checksum IN (SELECT sha256(('poison' || i)::bytea) FROM generate_series(1, 25) i)""")
    growth = _health(defs, instance)["dead_letter_growth"]
    assert not growth.passed
    assert growth.metadata["failed_last_hour"].value == 25 and growth.metadata["threshold_per_hour"].value == 10
    # A higher threshold from the environment passes the same burst.
    monkeypatch.setenv("PIPELINE_DLQ_GROWTH_PER_HOUR", "30")
    assert _health(defs, instance)["dead_letter_growth"].passed
    monkeypatch.delenv("PIPELINE_DLQ_GROWTH_PER_HOUR")
    # Large but not growing (failed hours ago): passes. Depth is not the signal.
    conn.execute("UPDATE app.embedding_jobs SET updated_at = now() - interval '3 hours' WHERE status = 'failed'")
    growth = _health(defs, instance)["dead_letter_growth"]
    assert growth.passed and growth.metadata["failed_total"].value == 25


def test_reconcile_job_reports_counts(corpus, conn, fake):
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["doc0000.md"])
    assert execute(defs, instance, partition_key="doc0000.md").success
    (corpus / "doc0003.md").unlink()
    result = execute(defs, instance, job="reconcile_job")
    assert result.success
    (output,) = [e for e in result.all_node_events if e.event_type_value == "STEP_OUTPUT"]
    metadata = {k: v.value for k, v in output.step_output_data.metadata.items()}
    # The rescan ingests the two documents never materialized in Dagster (doc0003 is gone).
    assert metadata["sources"] == 1 and metadata["new"] == 2 and metadata["deleted"] == 0
    assert metadata["missing_sources"] == 0 and "duration_seconds" in metadata
