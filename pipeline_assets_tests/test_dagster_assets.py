"""The assets in-process against real PostgreSQL and the fake OpenAI server."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app import reports
from pipeline_assets.defs.checks import COVERAGE_CHECK
from pipeline_assets_tests.conftest import FAKE_MODEL, write_corpus
from pipeline_assets_tests.dagster_helpers import (check_results, execute, fresh_defs, latest_data_versions,
                                                   latest_materializations, materialization_metadata, range_tags,
                                                   stale_status)


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    write_corpus(root, 4)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    return root


def test_materialize_one_partition_then_again_without_provider_calls(corpus, conn, fake):
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["doc0000.md", "doc0001.md"])

    result = execute(defs, instance, partition_key="doc0000.md")
    assert result.success
    doc = reports.document_summaries(conn, str(corpus.resolve()), ["doc0000.md"])["doc0000.md"]
    assert doc.status == "current" and doc.chunks >= 1
    # Only the partition's document was ingested.
    assert conn.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 1
    emb = materialization_metadata(result, "embeddings")
    assert emb["embedded"] == doc.chunks and emb["reused"] == 0 and emb["failed"] == 0
    assert emb["provider_calls"] >= 1 and emb["tokens"] > 0 and emb["coverage_ratio"] == 1.0
    assert emb["model"] == f"openai/{FAKE_MODEL}"
    # Data versions: the text checksum and the digest of the chunk checksums; one event per asset.
    (docs_event,) = [e for e in result.asset_materializations_for_node("ingest") if e.asset_key.path == ["documents"]]
    assert docs_event.tags["dagster/data_version"] == doc.text_checksum
    assert docs_event.metadata["text_checksum"].value == doc.text_checksum
    (chunks_event,) = [e for e in result.asset_materializations_for_node("ingest") if e.asset_key.path == ["chunks"]]
    assert chunks_event.tags["dagster/data_version"] == doc.chunks_digest
    assert chunks_event.tags["dagster/code_version"].startswith("tok-window-1/")
    (coverage,) = check_results(result).values()
    assert coverage.check_name == COVERAGE_CHECK and coverage.partition == "doc0000.md" and coverage.passed
    billed = fake.stats["billed_inputs"]
    requests = fake.stats["requests"]

    again = execute(defs, instance, partition_key="doc0000.md")
    assert again.success
    assert fake.stats["requests"] == requests and fake.stats["billed_inputs"] == billed
    emb = materialization_metadata(again, "embeddings")
    assert emb["embedded"] == 0 and emb["provider_calls"] == 0 and emb["reused"] == doc.chunks
    assert materialization_metadata(again, "ingest")["unchanged"] == 1
    # Same content, same data versions: nothing downstream looks changed.
    assert latest_data_versions(instance, "chunks", ["doc0000.md"]) == {"doc0000.md": doc.chunks_digest}
    assert stale_status(defs, instance, "embeddings", ["doc0000.md"])["doc0000.md"] == "FRESH"


def test_range_run_records_each_partitions_own_version_and_metadata(corpus, conn, fake):
    """A multi-partition run is one run; each partition's latest event carries its own checksum."""
    instance = dg.DagsterInstance.ephemeral()
    keys = [f"doc{i:04d}.md" for i in range(4)]
    instance.add_dynamic_partitions("documents", keys)
    result = execute(fresh_defs(), instance, tags=range_tags(keys))
    assert result.success
    summaries = reports.document_summaries(conn, str(corpus.resolve()), keys)
    assert len({s.text_checksum for s in summaries.values()}) == 4
    docs = latest_materializations(instance, "documents", keys)
    chunks = latest_materializations(instance, "chunks", keys)
    for key in keys:
        doc_event, chunk_event = docs[key].asset_materialization, chunks[key].asset_materialization
        assert doc_event.tags["dagster/data_version"] == summaries[key].text_checksum
        assert doc_event.metadata["text_checksum"].value == summaries[key].text_checksum
        assert chunk_event.tags["dagster/data_version"] == summaries[key].chunks_digest
        assert chunk_event.metadata["chunk_count"].value == summaries[key].chunks
        # Provenance as Dagster writes it: made from this document's version.
        assert chunk_event.tags["dagster/input_data_version/documents"] == summaries[key].text_checksum
    emb = materialization_metadata(result, "embeddings")
    assert emb["partitions"] == 4 and emb["coverage_ratio"] == 1.0
    assert emb["embedded"] == sum(s.chunks for s in summaries.values())
    assert {e.partition for e in result.get_asset_check_evaluations()} == set(keys)


def test_documents_and_chunks_cannot_be_materialized_apart(corpus, conn, fake):
    """documents and chunks are one ingest step: selecting one alone is refused, never half-done."""
    defs = fresh_defs()
    job = defs.resolve_implicit_global_asset_job_def()
    with pytest.raises(dg.DagsterInvalidSubsetError, match="does not support subsetting"):
        job.get_subset(asset_selection={dg.AssetKey("documents")})
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["doc0000.md"])
    assert execute(defs, instance, partition_key="doc0000.md").success
    # The UI's "materialize documents" materializes the step's required neighbours: both.
    both = dg.AssetSelection.assets("documents").required_multi_asset_neighbors()
    again = job.get_subset(asset_selection=both.resolve(defs.get_repository_def().asset_graph))
    assert again.execute_in_process(instance=instance, partition_key="doc0000.md").success
    statuses = {a: stale_status(defs, instance, a, ["doc0000.md"])["doc0000.md"]
                for a in ("documents", "chunks", "embeddings")}
    assert statuses == {"documents": "FRESH", "chunks": "FRESH", "embeddings": "FRESH"}


def test_a_pipe_in_a_partition_key_is_skipped_with_a_clear_log(corpus, conn, fake):
    (corpus / "bad|name.md").write_text("never ingested")
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["bad|name.md"])
    result = execute(fresh_defs(), instance, partition_key="bad|name.md")
    assert result.success
    assert materialization_metadata(result, "ingest")["skipped_invalid_keys"] == 1
    assert conn.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 0
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert any("skipping document 'bad|name.md'" in m and "'|'" in m for m in logs)


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
