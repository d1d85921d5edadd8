"""What the UI shows after a run over many partitions: each partition's own data version and staleness.

Read back from the instance's event log (the latest materialization of each
partition, as the UI reads it) and from Dagster's own staleness resolver.
"""

from __future__ import annotations

import time

import dagster as dg
import pytest

from pipeline_assets.app import reports
from pipeline_assets.defs.partition_versions import digest
from pipeline_assets_tests.conftest import FAKE_MODEL, write_corpus
from pipeline_assets_tests.dagster_helpers import (execute, fresh_defs, latest_data_versions,
                                                   latest_materializations, postgres_instance, range_tags,
                                                   stale_status)

N = 200
MODEL_ID = f"openai/{FAKE_MODEL}"


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    write_corpus(root, N, words=30)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    # As `pipeline-assets dev` and `pipeline-assets dagster-env` run Dagster: batched event writes.
    monkeypatch.setenv("DAGSTER_EVENT_BATCH_SIZE", "1000")
    return root


def _ingest_only(defs: dg.Definitions, instance: dg.DagsterInstance, keys: list[str]) -> None:
    """documents + chunks (one step) without embeddings, as a sensor batch or a UI backfill may run them."""
    job = defs.resolve_implicit_global_asset_job_def().get_subset(
        asset_selection={dg.AssetKey("documents"), dg.AssetKey("chunks")})
    tags = range_tags(keys) if len(keys) > 1 else {}
    result = job.execute_in_process(instance=instance, tags=tags,
                                    partition_key=keys[0] if len(keys) == 1 else None)
    assert result.success


def test_a_range_run_of_many_partitions_records_each_partitions_own_version(corpus, conn, fake, server_url):
    defs = fresh_defs()
    keys = [f"doc{i:04d}.md" for i in range(N)]
    with postgres_instance(server_url) as instance:
        instance.add_dynamic_partitions("documents", keys)
        started = time.monotonic()
        result = execute(defs, instance, tags=range_tags(keys))
        print(f"\nrange run of {N} partitions on PostgreSQL storage: {time.monotonic() - started:.1f}s "
              "(3 assets + the coverage check)")
        assert result.success

        summaries = reports.document_summaries(conn, str(corpus.resolve()), keys)
        per_doc, _ = reports.embedding_coverage(conn, str(corpus.resolve()), keys, MODEL_ID)
        assert len({s.text_checksum for s in summaries.values()}) == N
        assert latest_data_versions(instance, "documents", keys) == {k: s.text_checksum for k, s in summaries.items()}
        assert latest_data_versions(instance, "chunks", keys) == {k: s.chunks_digest for k, s in summaries.items()}
        assert latest_data_versions(instance, "embeddings", keys) == {
            k: digest(MODEL_ID, s.chunks_digest, f"{per_doc[k].ready}/{per_doc[k].wanted}")
            for k, s in summaries.items()}
        # The provenance Dagster's staleness reads: this partition's inputs, the code version.
        emb = latest_materializations(instance, "embeddings", keys)
        for key in keys:
            tags = emb[key].asset_materialization.tags
            assert tags["dagster/input_data_version/chunks"] == summaries[key].chunks_digest
            assert tags["dagster/code_version"] == MODEL_ID
            assert emb[key].asset_materialization.metadata["ready"].value == per_doc[key].wanted
        # Each partition has its own event, after the one Dagster writes for the whole range.
        all_docs = instance.fetch_materializations(dg.AssetKey("documents"), limit=10 * N).records
        assert len(all_docs) == 2 * N
        assert {r.asset_materialization.tags["dagster/data_version"] for r in all_docs[N:]} == {
            all_docs[-1].asset_materialization.tags["dagster/data_version"]}   # the range's, oldest first
        sample = keys[::10]   # Dagster resolves staleness partition by partition: a sample here
        assert set(stale_status(defs, instance, "embeddings", sample).values()) == {"FRESH"}

        # One document changes; documents + chunks re-run for the whole range (a sensor
        # batch, a parser-fix backfill). Only that document's embeddings look stale.
        changed = keys[7]
        (corpus / changed).write_text("# changed\n\nentirely new words here\n")
        _ingest_only(defs, instance, keys)
        stale = stale_status(defs, instance, "embeddings", keys)
        assert {k for k, s in stale.items() if s != "FRESH"} == {changed}
        assert set(stale_status(defs, instance, "chunks", sample).values()) == {"FRESH"}
        after = reports.document_summaries(conn, str(corpus.resolve()), [changed])[changed]
        assert latest_data_versions(instance, "documents", [changed]) == {changed: after.text_checksum}

        # Materializing that one partition makes everything fresh again.
        assert execute(defs, instance, partition_key=changed).success
        assert set(stale_status(defs, instance, "embeddings", [changed, *sample]).values()) == {"FRESH"}


def test_what_dagster_marks_stale_after_a_parser_or_chunker_change(corpus, conn, fake, monkeypatch):
    """The README's claims, as Dagster's resolver states them: a code-version bump marks that asset
    only; downstream turns stale only where the data version actually changed."""
    keys = [f"doc{i:04d}.md" for i in range(3)]

    def statuses(defs, instance):
        return {a: set(stale_status(defs, instance, a, keys).values()) for a in ("documents", "chunks", "embeddings")}

    def ingest(defs, instance):
        _ingest_only(defs, instance, keys)

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("documents", keys)
        assert execute(fresh_defs(), instance, tags=range_tags(keys)).success
        requests = fake.stats["requests"]
        monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
        defs = fresh_defs()
        assert statuses(defs, instance) == {"documents": {"STALE"}, "chunks": {"FRESH"}, "embeddings": {"FRESH"}}
        ingest(defs, instance)   # same texts: same data versions
        assert statuses(defs, instance) == {"documents": {"FRESH"}, "chunks": {"FRESH"}, "embeddings": {"FRESH"}}
        monkeypatch.setenv("PIPELINE_CHUNK_TOKENS", "24")
        monkeypatch.setenv("PIPELINE_CHUNK_OVERLAP", "4")
        defs = fresh_defs()
        assert statuses(defs, instance) == {"documents": {"FRESH"}, "chunks": {"STALE"}, "embeddings": {"FRESH"}}
        ingest(defs, instance)   # new chunks: new chunk checksums
        assert statuses(defs, instance) == {"documents": {"FRESH"}, "chunks": {"FRESH"}, "embeddings": {"STALE"}}
        assert fake.stats["requests"] == requests   # none of this embedded anything


def test_a_pdf_only_fix_reruns_pdf_partitions_and_the_ui_shows_their_version(corpus, conn, fake, monkeypatch):
    """A per-format bump is not a Dagster code version (one per asset) but a new observation of the
    ``extractor_version`` source asset for that format's partitions: once the rerun sensor observes it,
    Dagster marks exactly the PDF partitions stale, the sensor reruns exactly them, and afterwards all
    are fresh, each latest materialization carrying its own extractor version and data version."""
    from pipeline_assets.defs.rerun_sensor import rerun_stale_documents_sensor
    from pipeline_assets_tests.dagster_helpers import evaluate_sensor, requested_keys, stale_causes
    from pipeline_assets_tests.test_extract import make_pdf

    (corpus / "paper.pdf").write_bytes(make_pdf(["A paper on jittered retries", "and its second page"]))
    keys = ["doc0000.md", "doc0001.md", "paper.pdf"]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("documents", keys)
        assert execute(fresh_defs(), instance, tags=range_tags(keys)).success
        versions = latest_data_versions(instance, "documents", keys)
        requests = fake.stats["requests"]

        monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "pdf=extract-2")
        defs = fresh_defs()
        assert defs.get_repository_def().asset_graph.get(dg.AssetKey("documents")).code_version == "extract-1"
        for asset in ("documents", "chunks", "embeddings"):
            assert set(stale_status(defs, instance, asset, keys).values()) == {"FRESH"}
        tick = evaluate_sensor(rerun_stale_documents_sensor, defs, instance)
        # The tick observed the PDF's new extractor version: only its partition is stale.
        assert stale_status(defs, instance, "documents", keys) == {
            "doc0000.md": "FRESH", "doc0001.md": "FRESH", "paper.pdf": "STALE"}
        (cause,) = stale_causes(defs, instance, "documents", "paper.pdf")
        assert (cause.reason, cause.dependency.asset_key, cause.dependency.partition_key) == (
            "has a new dependency data version", dg.AssetKey("extractor_version"), "paper.pdf")
        for asset in ("chunks", "embeddings"):   # their inputs' data versions have not changed
            assert set(stale_status(defs, instance, asset, keys).values()) == {"FRESH"}
        (request,) = tick.run_requests
        assert requested_keys(instance, request) == ["paper.pdf"]
        assert execute(defs, instance, request).success

        latest = latest_materializations(instance, "documents", keys)
        assert {k: r.asset_materialization.metadata["extractor_version"].value for k, r in latest.items()} == \
            {"doc0000.md": "extract-1", "doc0001.md": "extract-1", "paper.pdf": "extract-2"}
        assert latest["paper.pdf"].run_id != latest["doc0000.md"].run_id     # only the PDF was rerun
        assert latest_data_versions(instance, "documents", keys) == versions  # same texts
        for asset in ("documents", "chunks", "embeddings"):
            assert set(stale_status(defs, instance, asset, keys).values()) == {"FRESH"}
        assert fake.stats["requests"] == requests
