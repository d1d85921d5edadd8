"""The assets in-process against real PostgreSQL and the fake OpenAI server: bucket partitions."""

from __future__ import annotations

import os
import threading
import time

import dagster as dg
import pytest

from pipeline_assets.app import buckets as bk
from pipeline_assets.app.buckets import bucket_of as bucket_index
from pipeline_assets.app.embed_selection import embed_buckets
from pipeline_assets.app.ingest import ingest_source
from pipeline_assets.defs.embeddings.assets import EMBEDDING_POOL
from pipeline_assets.defs.embeddings.checks import COVERAGE_CHECK
from pipeline_assets.defs.ingest.source_sensor import source_documents_sensor
from pipeline_assets.defs.partitions import MODEL_PARTITIONS_NAME, bucket_key, embedding_key, split_key
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.settings import Settings
from pipeline_assets.store import bucket_rows, reports
from pipeline_assets_tests.conftest import FAKE_MODEL, TEST_BUCKETS
from pipeline_assets_tests.dagster_helpers import (
    bucket_keys,
    bucket_of,
    check_results,
    embed_range_tags,
    evaluate_sensor,
    execute,
    fresh_defs,
    latest_data_versions,
    materialization_metadata,
    range_tags,
    stale_status,
)
from pipeline_assets_tests.dagster_instances import postgres_instance
from pipeline_assets_tests.data_helpers import bucket_documents, bucket_states, job_counts, write_corpus
from pipeline_assets_tests.processes import kill_group, start_cli, wait_until

DOCS = [f"doc{i:04d}.md" for i in range(4)]
N = TEST_BUCKETS
ALL = bucket_keys(N)
pytestmark = pytest.mark.usefixtures("in_process_buckets")


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    for path in write_corpus(root, 4):
        old = time.time() - 3600  # not "just modified": the scan's prefilter trusts size and mtime
        os.utime(path, (old, old))
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    # The tests below rely on these four documents having a bucket each.
    assert len({bucket_of(d) for d in DOCS}) == 4
    return root


def _meta(event) -> dict:
    return {k: v.value for k, v in event.metadata.items()}


def _partition_events(result, node: str, asset: str) -> dict[str, dict]:
    """Each partition's metadata, keyed by bucket (an embeddings partition: its bucket of the one model)."""
    return {
        bucket_key(split_key(e.partition)[0]) if "|" in e.partition else e.partition: _meta(e)
        for e in result.asset_materializations_for_node(node)
        if e.asset_key.path == [asset]
    }


def test_bucket_hash_is_stable_and_the_same_in_sql(conn):
    ids = ["a.md", "dir/b.html", "ünïcode/ß.txt", "x%25y.md", *DOCS]
    rows = dict(conn.execute("SELECT d, app.document_bucket(d, 64) FROM unnest(%s::text[]) AS d", (ids,)).fetchall())
    assert rows == {d: bucket_index(d, 64) for d in ids}
    assert all(0 <= b < 64 for b in rows.values())
    assert bucket_index("a.md", 64) == bucket_index("a.md", 64)  # deterministic (no salt)
    assert len({bucket_index(f"doc{i}.md", 64) for i in range(2000)}) == 64  # every bucket gets documents


def test_materialize_one_bucket_then_again_without_provider_calls_or_reads(corpus, conn, fake):
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    key = bucket_of("doc0000.md")

    result = execute(defs, instance, partition_key=key)
    assert result.success
    doc = reports.document_summaries(conn, str(corpus.resolve()), ["doc0000.md"])["doc0000.md"]
    assert doc.status == "current" and doc.chunks >= 1
    # Only the bucket's document was ingested.
    assert conn.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 1
    emb = materialization_metadata(result, "embeddings")
    assert emb["embedded"] == doc.chunks and emb["reused"] == 0 and emb["failed"] == 0
    assert emb["provider_calls"] >= 1 and emb["tokens"] > 0 and emb["coverage_ratio"] == 1.0
    assert emb["model"] == f"openai/{FAKE_MODEL}" and emb["documents"] == 1
    ingest = materialization_metadata(result, "ingest")
    # A new file is read once, by its ingest: the scan lists it without reading it.
    assert ingest["changed_documents"] == 1 and ingest["files_read"] == 0
    # One event per asset; a one-bucket run records the bucket's own version.
    (docs_event,) = [e for e in result.asset_materializations_for_node("ingest") if e.asset_key.path == ["documents"]]
    assert docs_event.partition == key
    assert docs_event.metadata["documents"].value == 1 and docs_event.metadata["current"].value == 1
    assert docs_event.tags["dagster/data_version"] == docs_event.metadata["text_digest"].value
    (chunks_event,) = [e for e in result.asset_materializations_for_node("ingest") if e.asset_key.path == ["chunks"]]
    assert chunks_event.tags["dagster/data_version"] == chunks_event.metadata["chunks_digest"].value
    assert chunks_event.metadata["chunk_count"].value == doc.chunks
    assert chunks_event.tags["dagster/code_version"].startswith("tok-window-1/")
    (coverage,) = check_results(result).values()
    assert coverage.check_name == COVERAGE_CHECK and coverage.passed
    assert coverage.partition == str(embedding_key(key, f"openai/{FAKE_MODEL}"))  # bucket x model
    assert coverage.metadata["chunks"].value == doc.chunks
    billed, requests = fake.stats["billed_inputs"], fake.stats["requests"]

    again = execute(defs, instance, partition_key=key)
    assert again.success
    assert fake.stats["requests"] == requests and fake.stats["billed_inputs"] == billed
    emb = materialization_metadata(again, "embeddings")
    assert emb["embedded"] == 0 and emb["provider_calls"] == 0 and emb["reused"] == doc.chunks
    ingest = materialization_metadata(again, "ingest")
    assert ingest["files_read"] == 0 and ingest["changed_documents"] == 0 and ingest["scanned"] == 0
    # Same content, same data versions: nothing downstream looks changed.
    assert latest_data_versions(instance, "chunks", [key]) == {key: chunks_event.metadata["chunks_digest"].value}
    assert stale_status(defs, instance, "embeddings", [key])[key] == "FRESH"


def test_a_backfill_of_every_bucket_is_one_run_with_per_bucket_metadata(corpus, conn, fake):
    """A range over all buckets: one run; each bucket's events carry its own counts and digests."""
    instance = dg.DagsterInstance.ephemeral()
    result = execute(fresh_defs(), instance, tags=range_tags(ALL))
    assert result.success
    summaries = reports.document_summaries(conn, str(corpus.resolve()), DOCS)
    docs = _partition_events(result, "ingest", "documents")
    chunks = _partition_events(result, "ingest", "chunks")
    embs = _partition_events(result, "embeddings", "embeddings")
    assert set(docs) == set(chunks) == set(embs) == set(ALL)
    for d in DOCS:
        key = bucket_of(d)
        assert docs[key]["documents"] == 1 and docs[key]["current"] == 1
        assert chunks[key]["chunk_count"] == summaries[d].chunks
        assert embs[key]["ready"] == embs[key]["chunks"] == summaries[d].chunks
    empty = next(k for k in ALL if k not in {bucket_of(d) for d in DOCS})
    assert docs[empty]["documents"] == 0 and embs[empty]["chunks"] == 0
    emb = materialization_metadata(result, "embeddings")
    assert emb["partitions"] == N and emb["coverage_ratio"] == 1.0
    assert emb["embedded"] == sum(s.chunks for s in summaries.values())
    assert {e.partition for e in result.get_asset_check_evaluations()} == {  # one per bucket (and model)
        str(embedding_key(k, f"openai/{FAKE_MODEL}")) for k in ALL
    }
    # A range run records one version for the range (Dagster 1.13), never a bucket's own.
    versions = latest_data_versions(instance, "documents", ALL)
    assert len(set(versions.values())) == 1 and next(iter(versions.values())).startswith(f"range:{N}:")

    # Nothing changed: the no-op backfill reads no file and calls no provider.
    billed = fake.stats["billed_inputs"]
    again = execute(fresh_defs(), instance, tags=range_tags(ALL))
    assert again.success and fake.stats["billed_inputs"] == billed
    ingest = materialization_metadata(again, "ingest")
    assert ingest["files_read"] == 0 and ingest["scanned"] == 0


def test_a_changed_and_a_deleted_document_are_synced_in_their_buckets(corpus, conn, fake):
    instance = dg.DagsterInstance.ephemeral()
    defs = fresh_defs()
    assert execute(defs, instance, tags=range_tags(ALL)).success
    (corpus / "doc0001.md").write_text("# changed\n\nbrand new words entirely\n")
    (corpus / "doc0002.md").unlink()
    billed = fake.stats["billed_inputs"]
    result = execute(defs, instance, tags=range_tags(ALL))
    assert result.success
    ingest = materialization_metadata(result, "ingest")
    assert ingest["changed_documents"] == 1 and ingest["gone_documents"] == 1 and ingest["files_read"] == 1
    assert fake.stats["billed_inputs"] == billed + 1  # only the changed chunk was sent
    s = reports.document_summaries(conn, str(corpus.resolve()), ["doc0001.md", "doc0002.md"])
    assert s["doc0001.md"].status == "current" and s["doc0002.md"].status == "deleted"
    docs = _partition_events(result, "ingest", "documents")
    assert docs[bucket_of("doc0002.md")]["documents"] == 0


def test_a_quarantined_document_is_named_in_its_buckets_metadata(corpus, conn, fake):
    (corpus / "doc0003.md").write_bytes(b"\xff\xfe not utf-8 \x80")
    key = bucket_of("doc0003.md")
    result = execute(fresh_defs(), dg.DagsterInstance.ephemeral(), partition_key=key)
    assert result.success
    docs = _partition_events(result, "ingest", "documents")
    assert docs[key]["quarantined"] == 1 and docs[key]["quarantined_ids"] == "doc0003.md"


def test_documents_and_chunks_cannot_be_materialized_apart(corpus, conn, fake):
    """documents and chunks are one ingest step: selecting one alone is refused, never half-done."""
    defs = fresh_defs()
    job = defs.resolve_implicit_global_asset_job_def()
    with pytest.raises(dg.DagsterInvalidSubsetError, match="does not support subsetting"):
        job.get_subset(asset_selection={dg.AssetKey("documents")})
    instance = dg.DagsterInstance.ephemeral()
    key = bucket_of("doc0000.md")
    assert execute(defs, instance, partition_key=key).success
    # The UI's "materialize documents" materializes the step's required neighbours: both.
    both = dg.AssetSelection.assets("documents").required_multi_asset_neighbors()
    again = job.get_subset(asset_selection=both.resolve(defs.get_repository_def().asset_graph))
    assert again.execute_in_process(instance=instance, partition_key=key).success
    statuses = {a: stale_status(defs, instance, a, [key])[key] for a in ("documents", "chunks", "embeddings")}
    assert statuses == {"documents": "FRESH", "chunks": "FRESH", "embeddings": "FRESH"}


def test_a_bucket_count_other_than_the_databases_fails_with_one_line(corpus, conn, fake, monkeypatch):
    assert execute(fresh_defs(), dg.DagsterInstance.ephemeral(), partition_key="b000").success  # fixes N
    monkeypatch.setenv("PIPELINE_PARTITION_BUCKETS", "8")
    result = execute(fresh_defs(), dg.DagsterInstance.ephemeral(), partition_key="b000")
    assert not result.success
    description = result.failure_data_for_node("ingest").user_failure_data.description
    assert f"{N} buckets" in description and f"PIPELINE_PARTITION_BUCKETS={N}" in description
    assert "\n" not in description


def test_refresh_and_reconciliation_runs_check_the_bucket_count_too(corpus, conn, fake, monkeypatch):
    """Every run that reports buckets checks the count: with 8 configured on a database of N buckets,
    refresh_documents and the reconciliation fail with one line before changing anything."""
    assert execute(fresh_defs(), dg.DagsterInstance.ephemeral(), partition_key="b000").success  # fixes N
    billed = fake.stats["billed_inputs"]
    monkeypatch.setenv("PIPELINE_PARTITION_BUCKETS", "8")
    (corpus / "doc0001.md").write_text("# edited\n\nwords nobody ingested yet\n")
    before = conn.execute("SELECT document_id, status, source_checksum FROM app.documents ORDER BY 1").fetchall()
    defs = fresh_defs()
    refresh = defs.resolve_job_def("refresh_documents").execute_in_process(
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
        run_config={"ops": {"refresh_documents_op": {"config": {"document_ids": ["doc0001.md"]}}}},
    )
    reconcile = execute(defs, dg.DagsterInstance.ephemeral(), job="reconcile_job")
    for result, node in ((refresh, "refresh_documents_op"), (reconcile, "reconciliation")):
        assert not result.success
        description = result.failure_data_for_node(node).user_failure_data.description
        assert f"{N} buckets" in description and f"PIPELINE_PARTITION_BUCKETS={N}" in description
        assert "\n" not in description
    after = conn.execute("SELECT document_id, status, source_checksum FROM app.documents ORDER BY 1").fetchall()
    assert after == before and fake.stats["billed_inputs"] == billed


def test_refresh_documents_rematerializes_one_document_by_run_config(corpus, conn, fake, server_url):
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    assert execute(defs, instance, tags=range_tags(ALL)).success
    (corpus / "doc0001.md").write_text("# edited\n\nfresh text for one document\n")
    billed = fake.stats["billed_inputs"]
    job = defs.resolve_job_def("refresh_documents")
    result = job.execute_in_process(
        instance=instance, run_config={"ops": {"refresh_documents_op": {"config": {"document_ids": ["doc0001.md"]}}}}
    )
    assert result.success
    assert fake.stats["billed_inputs"] == billed + 1
    text = conn.execute(
        "SELECT c.text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = 'doc0001.md'"
    ).fetchone()[0]
    assert "fresh text for one document" in text
    key = bucket_of("doc0001.md")
    events = {
        tuple(e.asset_key.path): e
        for e in result.get_asset_materialization_events()
        for e in [e.event_specific_data.materialization]
    }
    assert set(events) == {("documents",), ("chunks",), ("embeddings",)}
    assert events[("documents",)].partition == events[("chunks",)].partition == key
    assert events[("embeddings",)].partition == str(embedding_key(key, f"openai/{FAKE_MODEL}"))  # x the model
    assert events[("documents",)].metadata["refreshed_documents"].value == "doc0001.md"
    assert events[("embeddings",)].metadata["ready"].value == events[("embeddings",)].metadata["refreshed_chunks"].value
    # The source sensor's next tick reads the edited file and finds it synced: no bucket run for it.
    with postgres_instance(server_url) as ticks:  # a sensor tick needs an instance it can share
        tick = evaluate_sensor(source_documents_sensor, defs, ticks)
    assert not tick.run_requests and "no change" in tick.skip_message
    # A glob, and a clear refusal when it matches nothing.
    result = job.execute_in_process(
        instance=instance,
        raise_on_error=False,
        run_config={"ops": {"refresh_documents_op": {"config": {"glob": "nothing-*.pdf"}}}},
    )
    assert not result.success
    assert "matches no file" in result.failure_data_for_node("refresh_documents_op").user_failure_data.description
    result = job.execute_in_process(
        instance=instance, run_config={"ops": {"refresh_documents_op": {"config": {"glob": "doc000[23].md"}}}}
    )
    assert result.success and result.output_for_node("refresh_documents_op") == ["doc0002.md", "doc0003.md"]


# -- an embeddings run waits for its own partitions only ------------------------------------------


def _write_backlog(root, n_docs: int, words: int) -> None:
    """Documents whose every chunk is distinct text (so each is a job of its own)."""
    root.mkdir(parents=True)
    for i in range(n_docs):
        (root / f"b{i:04d}.md").write_text(" ".join(f"b{i}x{j}" for j in range(words)) + "\n")


def _doc_chunks(conn, document_id: str) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT c.text FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = %s",
            (document_id,),
        )
    ]


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
    started = time.monotonic()
    result = execute(defs, instance, partition_key=bucket_of("doc0000.md"))
    elapsed = time.monotonic() - started
    assert result.success
    own = _doc_chunks(conn, "doc0000.md")
    assert own and fake.stats["billed_inputs"] == len(own)  # only its chunks were sent...
    assert all(fake.billed_count(text) == 1 for text in own)
    assert job_counts(conn)["pending"] == waiting  # ...and the backlog is untouched
    emb = materialization_metadata(result, "embeddings")
    assert emb["embedded"] == len(own) and emb["coverage_ratio"] == 1.0 and emb["in_process"] is True
    assert check_results(result)[COVERAGE_CHECK].passed
    print(f"one partition, {waiting} jobs of other documents pending: {elapsed:.2f} s")


def test_external_workers_mode_waits_for_a_work_process(corpus, conn, fake, env, monkeypatch):
    """Scale-out: the run starts no worker; a real `work` process embeds; the run ends when its chunks are ready."""
    monkeypatch.setenv("PIPELINE_EMBED_WORKERS", "external")
    defs = fresh_defs()
    assert defs.get_assets_def("embeddings").op.pool is None  # no fleet in the run: no pool slot to take
    instance = dg.DagsterInstance.ephemeral()
    worker = start_cli("work", env={**env, "PIPELINE_EMBED_WORKERS": "external"})
    try:
        result = execute(defs, instance, partition_key=bucket_of("doc0001.md"))
    finally:
        kill_group(worker)
    assert result.success
    emb = materialization_metadata(result, "embeddings")
    own = _doc_chunks(conn, "doc0001.md")
    assert emb["in_process"] is False and emb["provider_calls"] == 0  # the run itself called nobody
    assert emb["coverage_ratio"] == 1.0 and fake.stats["billed_inputs"] == len(own)


def test_the_deadline_fails_the_run_with_its_counts(corpus, conn, fake):
    """External workers that never come: a short deadline (launchpad config) fails the run, saying how many wait."""
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    started = time.monotonic()
    result = execute(
        defs,
        instance,
        partition_key=bucket_of("doc0002.md"),
        run_config=_run_config(in_process=False, deadline_seconds=1.0),
    )
    assert not result.success and time.monotonic() - started < 300  # its 1 s deadline, not the default hour
    description, metadata = _failure(result)
    own = len(_doc_chunks(conn, "doc0002.md"))
    assert description.startswith("deadline passed: ") and "after 1 s" in description
    assert metadata == {
        "chunks": own,
        "ready": 0,
        "failed": 0,
        "outstanding": own,
        "partitions": 1,
        "in_process": False,
        "model": f"openai/{FAKE_MODEL}",
    }
    assert fake.stats["requests"] == 0
    assert not result.asset_materializations_for_node("embeddings")  # no materialization claims coverage


def test_a_spent_token_budget_fails_the_run_with_its_message(corpus, conn, fake, tmp_path, monkeypatch):
    root = tmp_path / "big"
    _write_backlog(root, 1, 3000)  # one document of many chunks
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    monkeypatch.setenv("PIPELINE_RUN_TOKEN_BUDGET", "1")
    monkeypatch.setenv("PIPELINE_BATCH_INPUTS", "1")
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    result = execute(defs, instance, partition_key=bucket_of("b0000.md"))
    assert not result.success
    description, metadata = _failure(result)
    assert description.startswith("embedding stopped: run token budget of 1 reached")
    own = len(_doc_chunks(conn, "b0000.md"))
    assert own > 8 and 0 < metadata["ready"] < own and metadata["outstanding"] == own - metadata["ready"]
    assert fake.stats["billed_inputs"] == metadata["ready"]  # what was sent got its vector; the rest waits
    assert job_counts(conn)["pending"] == metadata["outstanding"]


def test_runs_take_turns_in_the_embedding_worker_pool(corpus, conn, fake, server_url):
    """The instance `pipeline-assets dev` configures (pool limit 1): while another run's embeddings step
    holds the slot, this run's step waits, starting no worker; it embeds once the slot is free."""
    defs = fresh_defs()
    with postgres_instance(server_url) as instance:
        assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default(EMBEDDING_POOL)
        assert storage.claim_concurrency_slot(EMBEDDING_POOL, "another-run", "embeddings").is_claimed
        results = []
        key = bucket_of("doc0003.md")
        run = threading.Thread(target=lambda: results.append(execute(defs, instance, partition_key=key)))
        run.start()
        # The run's embeddings step asks for the slot and waits (observed in the pool's pending steps).
        wait_until(
            lambda: storage.get_concurrency_info(EMBEDDING_POOL).pending_step_count >= 1,
            timeout=120,
            what="the embeddings step to wait for the pool slot",
        )
        assert run.is_alive() and fake.stats["requests"] == 0  # blocked on the pool: no worker
        assert job_counts(conn).get("pending", 0) > 0  # (ingest ran: its step is not pooled)
        storage.free_concurrency_slot_for_step("another-run", "embeddings")
        run.join(120)
        assert results and results[0].success
        assert fake.stats["billed_inputs"] == len(_doc_chunks(conn, "doc0003.md"))
        assert storage.get_concurrency_info(EMBEDDING_POOL).active_slot_count == 0  # freed at the step's end


def test_bucket_states_grouped_in_sql_are_the_summaries_own(corpus, conn, fake):
    """states_of (one grouped query) gives each bucket the counts and digests bucket_states computes
    from the documents' summaries: current, quarantined (with and without text), deleted, non-ASCII."""
    (corpus / "binary.md").write_bytes(b"\x00\x01\x02 not text")
    (corpus / "ünïcode ß.md").write_text("# ü\n\nsome words here\n")
    (corpus / "empty.md").write_text("")
    with dg.build_resources(build_resources(Settings.from_env())) as res:
        rt, pool = res.embedding_provider.runtime(), res.postgres.pool()
        ingest_source(rt, pool, corpus)
        (corpus / "doc0002.md").unlink()
        ingest_source(rt, pool, corpus)
    root, n = str(corpus.resolve()), N
    buckets = list(range(n))
    from_sql = bucket_rows.states_of(conn, root, buckets, n)
    summaries = reports.document_summaries(conn, root, bucket_documents(conn, root, buckets, n))
    assert from_sql == bucket_states(summaries, buckets, n)
    assert sum(s.documents for s in from_sql.values()) == 6 and sum(s.quarantined for s in from_sql.values()) >= 1
    assert [s.quarantined_ids for s in from_sql.values() if s.quarantined_ids] == [["binary.md"]]


def test_bucket_coverage_grouped_in_sql_is_the_documents_own(corpus, conn, fake):
    """coverage_and_total (what an embeddings run reads) gives each bucket the sums of its documents'
    coverage, and the total over distinct chunks: a text two documents share counts once there."""
    (corpus / "twin.md").write_text((corpus / "doc0001.md").read_text())  # the same chunk as doc0001
    (corpus / "binary.md").write_bytes(b"\x00\x01\x02 not text")  # quarantined: no chunk
    with dg.build_resources(build_resources(Settings.from_env())) as res:
        rt, pool = res.embedding_provider.runtime(), res.postgres.pool()
        ingest_source(rt, pool, corpus)
        root, n, model = str(corpus.resolve()), N, rt.model_id
        buckets = list(range(n))
        ids = bucket_documents(conn, root, buckets, n)
        for step in ("waiting", "embedded"):
            per_doc, total = reports.embedding_coverage(conn, root, ids, model)
            per_bucket, sql_total = bucket_rows.coverage_and_total(conn, root, buckets, n, model)
            assert per_bucket == bk.bucket_coverage(per_doc, buckets, n), step
            assert sql_total == total, step
            assert sum(c.chunks for c in per_bucket.values()) == total.wanted + 1, step  # the twin
            if step == "waiting":
                assert total.ready == 0 and total.waiting == total.wanted
                embed_buckets(rt, pool, corpus.resolve(), buckets, n, poll_seconds=0.05)
        assert total.ready == total.wanted > 0 and not total.failed
        assert sorted(bucket_rows.current_pks(conn, root, buckets, n)) == sorted(
            r[0] for r in conn.execute("SELECT doc_pk FROM app.documents WHERE status = 'current'")
        )


def test_a_corpus_ingested_by_the_cli_is_not_ingested_again_by_the_first_bucket_run(corpus, conn, fake):
    """Bytes already in the store (the command line's ingest, or the per-document scheme before buckets)
    are only recorded as synced: no extraction, no provider call."""
    with dg.build_resources(build_resources(Settings.from_env())) as res:
        ingest_source(res.embedding_provider.runtime(), res.postgres.pool(), corpus)
    before = conn.execute("SELECT max(updated_at) FROM app.documents").fetchone()[0]
    result = execute(fresh_defs(), dg.DagsterInstance.ephemeral(), tags=range_tags(ALL))
    assert result.success
    ingest = materialization_metadata(result, "ingest")
    # New to the scan, so not read by it: the ingest reads each file once and finds its bytes stored.
    assert ingest["files_read"] == 0 and ingest["scanned"] == 4 and ingest["unchanged"] == 4
    assert ingest["new"] == ingest["changed"] == ingest["chunks"] == 0
    assert conn.execute("SELECT max(updated_at) FROM app.documents").fetchone()[0] == before
    assert conn.execute("SELECT count(*) FROM app.source_observations WHERE synced = checksum").fetchone()[0] == 4
    again = execute(fresh_defs(), dg.DagsterInstance.ephemeral(), tags=range_tags(ALL))
    assert materialization_metadata(again, "ingest")["files_read"] == 0


def test_a_bucket_run_works_in_pages_of_bounded_size(corpus, conn, fake, monkeypatch):
    """sync_buckets reads, ingests and records its unsynced documents a page at a time (here pages
    of 2 documents): no ingest call gets more, and the pages together do what one would."""
    monkeypatch.setattr(bk, "SYNC_PAGE_DOCUMENTS", 2)
    calls: list[int] = []
    real = bk.ingest_documents
    monkeypatch.setattr(
        bk, "ingest_documents", lambda rt, pool, root, ids: calls.append(len(ids)) or real(rt, pool, root, ids)
    )
    for i in range(4, 9):
        (corpus / f"doc{i:04d}.md").write_text(f"# extra {i}\n\nwords of page {i}\n")
        os.utime(corpus / f"doc{i:04d}.md", (time.time() - 3600,) * 2)
    with dg.build_resources(build_resources(Settings.from_env())) as res:
        rt, pool = res.embedding_provider.runtime(), res.postgres.pool()
        first = bk.sync_buckets(rt, pool, corpus, range(N), N)
        assert (first.changed, first.gone, first.report.new) == (9, 0, 9) and calls and max(calls) <= 2
        assert sum(calls) == 9
        assert (
            conn.execute(
                "SELECT count(*) FROM app.source_observations WHERE synced = checksum AND checksum NOT LIKE '~%%'"
            ).fetchone()[0]
            == 9
        )
        (corpus / "doc0001.md").write_text("# changed\n\nother words\n")
        for gone in ("doc0002.md", "doc0005.md", "doc0007.md"):
            (corpus / gone).unlink()
        calls.clear()
        second = bk.sync_buckets(rt, pool, corpus, range(N), N)
        assert (second.changed, second.gone, second.report.changed, second.report.deleted) == (1, 3, 1, 3)
        assert max(calls) <= 2 and sum(calls) == 4
        calls.clear()
        third = bk.sync_buckets(rt, pool, corpus, range(N), N)
        assert (third.changed, third.gone, third.stale, calls) == (0, 0, 0, [])
    statuses = dict(conn.execute("SELECT document_id, status FROM app.documents").fetchall())
    assert sorted(d for d, s in statuses.items() if s == "deleted") == ["doc0002.md", "doc0005.md", "doc0007.md"]
    assert sum(s == "current" for s in statuses.values()) == 6


def test_a_bucket_run_after_a_version_bump_reads_only_its_buckets_stale_documents_in_pages(
    corpus, conn, fake, monkeypatch
):
    """After a parser fix a run over some buckets selects their stale documents in the database, a
    page at a time (pages of 2 here): it never reads another bucket's, nor more than a page at once."""
    from pipeline_assets.store import stage_runs

    for i in range(4, 12):
        (corpus / f"doc{i:04d}.md").write_text(f"# extra {i}\n\nwords of document {i}\n")
        os.utime(corpus / f"doc{i:04d}.md", (time.time() - 3600,) * 2)
    docs = sorted(p.name for p in corpus.iterdir())
    assert execute(fresh_defs(), dg.DagsterInstance.ephemeral(), tags=range_tags(ALL)).success
    wanted = sorted({bucket_index(d, N) for d in docs[:2]})
    inside = [d for d in docs if bucket_index(d, N) in wanted]
    assert 3 <= len(inside) < len(docs)

    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
    monkeypatch.setattr(bk, "SYNC_PAGE_DOCUMENTS", 2)
    reads: list[list[str]] = []
    real = stage_runs.rerun_targets

    def recorded(conn, **filters):
        rows = real(conn, **filters)
        reads.append([t.document_id for t in rows])
        return rows

    monkeypatch.setattr(stage_runs, "rerun_targets", recorded)
    with dg.build_resources(build_resources(Settings.from_env())) as res:
        done = bk.sync_buckets(res.embedding_provider.runtime(), res.postgres.pool(), corpus, wanted, N)
    assert done.stale == len(inside) and done.changed == 0
    assert reads and max(len(r) for r in reads) <= 2
    assert sorted(d for r in reads for d in r) == inside  # only its buckets' documents, each once
    versions = dict(
        conn.execute(
            "SELECT d.document_id, s.code_version FROM app.stage_runs s "
            "JOIN app.documents d USING (doc_pk) WHERE s.stage = 'extract'"
        ).fetchall()
    )
    assert versions == {d: "extract-2" if d in inside else "extract-1" for d in docs}


# -- runtime materializations carry data and code versions -----------------------------------------


def test_after_a_refresh_dagsters_staleness_is_the_buckets_own(corpus, conn, fake, monkeypatch):
    """refresh_documents records its buckets with their data and code versions: a code version bump
    afterwards makes the refreshed bucket stale like every other, and an unchanged bucket run after
    the refresh leaves every bucket fresh (Dagster's own verdict, what the UI shows). A model change
    is a new column of embeddings, not a code change."""
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    assert execute(defs, instance, tags=range_tags(ALL)).success
    (corpus / "doc0001.md").write_text("# edited\n\nfresh text for one document\n")
    refreshed = bucket_of("doc0001.md")
    job = defs.resolve_job_def("refresh_documents")
    assert job.execute_in_process(
        instance=instance, run_config={"ops": {"refresh_documents_op": {"config": {"document_ids": ["doc0001.md"]}}}}
    ).success
    for asset in ("documents", "chunks", "embeddings"):
        assert set(stale_status(defs, instance, asset, ALL).values()) == {"FRESH"}, asset
    # An unchanged bucket run of the refreshed bucket and of another: nothing looks changed.
    other = bucket_of("doc0002.md")
    for key in (refreshed, other):
        assert execute(defs, instance, partition_key=key).success
    for asset in ("documents", "chunks", "embeddings"):
        assert set(stale_status(defs, instance, asset, ALL).values()) == {"FRESH"}, asset
    assert job.execute_in_process(
        instance=instance,
        run_config={"ops": {"refresh_documents_op": {"config": {"document_ids": ["doc0001.md"], "force": True}}}},
    ).success
    # A parser fix (the documents code version): every bucket is stale, the refreshed one too.
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
    bumped = fresh_defs()
    assert set(stale_status(bumped, instance, "documents", ALL).values()) == {"STALE"}
    # A new model is a new column: missing in every bucket, while the old model's vectors stay fresh.
    monkeypatch.delenv("PIPELINE_EXTRACTOR_VERSION")
    monkeypatch.setenv("PIPELINE_EMBEDDING_MODEL", "fake-embed-2")
    switched = fresh_defs()
    assert set(stale_status(switched, instance, "embeddings", ALL).values()) == {"MISSING"}
    assert set(stale_status(switched, instance, "embeddings", ALL, f"openai/{FAKE_MODEL}").values()) == {"FRESH"}


def test_a_refresh_leaves_another_models_cell_of_its_bucket_stale(corpus, conn, fake):
    """refresh_documents embeds with the configured model only: that model's cell of the bucket is
    fresh, another active model's cell of it is stale (its vectors of the new text are not made yet)
    until its run, and every other cell stays fresh."""
    from pipeline_assets.app import model_admin
    from pipeline_assets.store import db

    settings = Settings.from_env()
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    assert execute(defs, instance, tags=range_tags(ALL)).success
    with db.make_pool(db.database_url(settings.database_config()), max_size=2) as pool:
        other = model_admin.add(settings, pool, "fake-embed-2")["model_id"]
    instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, [other])  # what the sensors' next tick does
    assert execute(defs, instance, job="embed_documents", tags=embed_range_tags(ALL, [other])).success
    (corpus / "doc0001.md").write_text("# edited\n\nfresh text for one document\n")
    refreshed = bucket_of("doc0001.md")
    assert (
        defs.resolve_job_def("refresh_documents")
        .execute_in_process(
            instance=instance,
            run_config={"ops": {"refresh_documents_op": {"config": {"document_ids": ["doc0001.md"]}}}},
        )
        .success
    )
    configured = f"openai/{FAKE_MODEL}"
    assert set(stale_status(defs, instance, "embeddings", ALL, configured).values()) == {"FRESH"}
    assert stale_status(defs, instance, "embeddings", ALL, other) == {
        k: "STALE" if k == refreshed else "FRESH" for k in ALL
    }
    # Its run makes the new text's vectors: the cell is fresh again.
    assert execute(defs, instance, job="embed_documents", partition_key=str(embedding_key(refreshed, other))).success
    assert set(stale_status(defs, instance, "embeddings", ALL, other).values()) == {"FRESH"}
