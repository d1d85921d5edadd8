"""The assets in-process against real PostgreSQL and the fake OpenAI server."""

from __future__ import annotations

import threading
import time

import dagster as dg
import pytest

from pipeline_assets.app import reports
from pipeline_assets.app.ingest import ingest_source
from pipeline_assets.defs.assets import EMBEDDING_POOL
from pipeline_assets.defs.checks import COVERAGE_CHECK
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.settings import Settings
from pipeline_assets_tests.conftest import FAKE_MODEL, job_counts, kill_group, start_cli, write_corpus
from pipeline_assets_tests.dagster_helpers import (check_results, execute, fresh_defs, latest_data_versions,
                                                   latest_materializations, materialization_metadata,
                                                   postgres_instance, range_tags, stale_status)


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


# -- an embeddings run waits for its own partitions only ------------------------------------------


def _write_backlog(root, n_docs: int, words: int) -> None:
    """Documents whose every chunk is distinct text (so each is a job of its own)."""
    root.mkdir(parents=True)
    for i in range(n_docs):
        (root / f"b{i:04d}.md").write_text(" ".join(f"b{i}x{j}" for j in range(words)) + "\n")


def _doc_chunks(conn, document_id: str) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT c.text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = %s",
        (document_id,))]


def _failure(result: dg.ExecuteInProcessResult, node: str = "embeddings"):
    data = result.failure_data_for_node(node).user_failure_data
    return data.description, {k: v.value for k, v in data.metadata.items()}


def _run_config(**embedding_run) -> dict:
    return {"resources": {"embedding_run": {"config": embedding_run}}}


def test_one_partition_with_a_large_backlog_embeds_only_its_own_chunks(corpus, conn, fake, tmp_path):
    """Thousands of jobs of other documents wait; the run bills exactly its partition's chunks and ends."""
    backlog = tmp_path / "backlog"
    _write_backlog(backlog, 200, 1500)
    with dg.build_resources(build_resources(Settings.from_env())) as res:
        ingest_source(res.embedding_provider.runtime(), res.postgres.pool(), backlog)
    waiting = job_counts(conn)["pending"]
    assert waiting >= 2000
    defs = fresh_defs()
    assert defs.get_assets_def("embeddings").op.pool == EMBEDDING_POOL
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["doc0000.md"])
    started = time.monotonic()
    result = execute(defs, instance, partition_key="doc0000.md")
    elapsed = time.monotonic() - started
    assert result.success
    own = _doc_chunks(conn, "doc0000.md")
    assert own and fake.stats["billed_inputs"] == len(own)       # only its chunks were sent...
    assert all(fake.billed_count(text) == 1 for text in own)
    assert job_counts(conn)["pending"] == waiting                # ...and the backlog is untouched
    emb = materialization_metadata(result, "embeddings")
    assert emb["embedded"] == len(own) and emb["coverage_ratio"] == 1.0 and emb["in_process"] is True
    assert check_results(result)[COVERAGE_CHECK].passed
    print(f"one partition, {waiting} jobs of other documents pending: {elapsed:.2f} s")


def test_external_workers_mode_waits_for_a_work_process(corpus, conn, fake, env, monkeypatch):
    """Scale-out: the run starts no worker; a real `work` process embeds; the run ends when its chunks are ready."""
    monkeypatch.setenv("PIPELINE_EMBED_WORKERS", "external")
    defs = fresh_defs()
    assert defs.get_assets_def("embeddings").op.pool is None     # no fleet in the run: no pool slot to take
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["doc0001.md"])
    worker = start_cli("work", env={**env, "PIPELINE_EMBED_WORKERS": "external"})
    try:
        result = execute(defs, instance, partition_key="doc0001.md")
    finally:
        kill_group(worker)
    assert result.success
    emb = materialization_metadata(result, "embeddings")
    own = _doc_chunks(conn, "doc0001.md")
    assert emb["in_process"] is False and emb["provider_calls"] == 0   # the run itself called nobody
    assert emb["coverage_ratio"] == 1.0 and fake.stats["billed_inputs"] == len(own)


def test_the_deadline_fails_the_run_with_its_counts(corpus, conn, fake):
    """External workers that never come: a short deadline (launchpad config) fails the run, saying how many wait."""
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["doc0002.md"])
    job = defs.resolve_job_def("embed_documents")
    started = time.monotonic()
    result = job.execute_in_process(instance=instance, partition_key="doc0002.md", raise_on_error=False,
                                    run_config=_run_config(in_process=False, deadline_seconds=1.0))
    assert not result.success and time.monotonic() - started < 60
    description, metadata = _failure(result)
    own = len(_doc_chunks(conn, "doc0002.md"))
    assert description.startswith("deadline passed: ") and "after 1 s" in description
    assert metadata == {"chunks": own, "ready": 0, "failed": 0, "outstanding": own, "partitions": 1,
                        "in_process": False}
    assert fake.stats["requests"] == 0
    assert not result.asset_materializations_for_node("embeddings")   # no materialization claims coverage


def test_a_spent_token_budget_fails_the_run_with_its_message(corpus, conn, fake, tmp_path, monkeypatch):
    root = tmp_path / "big"
    _write_backlog(root, 1, 3000)                                 # one document of many chunks
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    monkeypatch.setenv("PIPELINE_RUN_TOKEN_BUDGET", "1")
    monkeypatch.setenv("PIPELINE_BATCH_INPUTS", "1")
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", ["b0000.md"])
    result = execute(defs, instance, partition_key="b0000.md")
    assert not result.success
    description, metadata = _failure(result)
    assert description.startswith("embedding stopped: run token budget of 1 reached")
    own = len(_doc_chunks(conn, "b0000.md"))
    assert own > 8 and 0 < metadata["ready"] < own and metadata["outstanding"] == own - metadata["ready"]
    assert fake.stats["billed_inputs"] == metadata["ready"]        # what was sent got its vector; the rest waits
    assert job_counts(conn)["pending"] == metadata["outstanding"]


def test_runs_take_turns_in_the_embedding_worker_pool(corpus, conn, fake, server_url):
    """The instance `pipeline-assets dev` configures (pool limit 1): while another run's embeddings step
    holds the slot, this run's step waits, starting no worker; it embeds once the slot is free."""
    defs = fresh_defs()
    with postgres_instance(server_url) as instance:
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
        instance.add_dynamic_partitions("documents", ["doc0003.md"])
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default(EMBEDDING_POOL)
        assert storage.claim_concurrency_slot(EMBEDDING_POOL, "another-run", "embeddings").is_claimed
        results = []
        run = threading.Thread(target=lambda: results.append(execute(defs, instance, partition_key="doc0003.md")))
        run.start()
        time.sleep(4)
        assert run.is_alive() and fake.stats["requests"] == 0          # blocked on the pool: no worker
        assert job_counts(conn).get("pending", 0) > 0                     # (ingest ran: its step is not pooled)
        storage.free_concurrency_slot_for_step("another-run", "embeddings")
        run.join(120)
        assert results and results[0].success
        assert fake.stats["billed_inputs"] == len(_doc_chunks(conn, "doc0003.md"))
        assert storage.get_concurrency_info(EMBEDDING_POOL).active_slot_count == 0   # freed at the step's end
