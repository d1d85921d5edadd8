"""The source sensor's run after a change syncs AND embeds the buckets of its edits: one run, no second
launch and no sensor interval before the vectors; what it records stays true (a bucket is FRESH only
once its vectors are, and a change observed during the run leaves it STALE), and no other run follows.
It does not walk the source again; a range run of ``sync_documents`` (the UI's "Materialize", a
backfill) walks it and syncs every bucket."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app import buckets as bk
from pipeline_assets.content import folder_source
from pipeline_assets.defs.embeddings.sensors import embed_after_sync
from pipeline_assets.defs.ingest import sync_and_embed
from pipeline_assets.defs.ingest.source_sensor import source_documents_sensor
from pipeline_assets.defs.keys import SOURCE_FILES
from pipeline_assets.defs.partitions import bucket_key
from pipeline_assets.defs.provenance import DATA_VERSION_TAG
from pipeline_assets.defs.run_requests import PENDING_TAG
from pipeline_assets.store import bucket_rows
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.dagster_helpers import (
    evaluate_sensor,
    execute,
    fresh_defs,
    latest_materializations,
    range_tags,
    requested_keys,
    served,
    stale_status,
)
from pipeline_assets_tests.data_helpers import write_corpus

N = 64
DOCS = 40
MODEL_ID = f"openai/{FAKE_MODEL}"


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    write_corpus(root, DOCS)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    clean_db.execute("TRUNCATE app.source_observations")
    return root


def _tick(defs, instance, cursor: str | None = None):
    """A source sensor tick, its observations of ``source_files`` recorded as the daemon records them."""
    return evaluate_sensor(source_documents_sensor, defs, instance, cursor, record_events=True)


def _stated(monkeypatch) -> list[str]:
    """The files a walk of the folder stats (examines), by document id."""
    stated: list[str] = []
    real = folder_source.walk

    def counting(root, keep=None):
        for row in real(root, keep):
            if row[1] != folder_source.NOT_STATED:
                stated.append(row[0])
            yield row

    monkeypatch.setattr(folder_source, "walk", counting)
    return stated


def _grouped_coverage_reads(monkeypatch) -> list[list[int]]:
    """The buckets of each ``coverage_of_buckets`` read (the check's own grouped read)."""
    reads: list[list[int]] = []
    real = bucket_rows.coverage_of_buckets

    def counting(conn, root, bucket_ids, bucket_count, model_id):
        reads.append(list(bucket_ids))
        return real(conn, root, bucket_ids, bucket_count, model_id)

    monkeypatch.setattr(bucket_rows, "coverage_of_buckets", counting)
    return reads


def _run_tags(request: dg.RunRequest) -> dict[str, str]:
    return {k: v for k, v in request.tags.items() if k != "dagster/partition"}


def _bucket(doc: str) -> int:
    return bk.bucket_of(doc, N)


def _edited_far_apart(defs, instance, corpus):
    """The corpus synced and embedded (the first tick's run), then the documents of the lowest and the
    highest bucket edited: (the tick that requests their run, the two documents, the range's keys,
    the cursor of ``embed_after_sync`` once it has seen that first run)."""
    first_tick = _tick(defs, instance)
    assert execute(defs, instance, first_tick.run_requests[0]).success  # every bucket, then its embeddings
    after_sync = evaluate_sensor(embed_after_sync, defs, instance)  # the first run's (run above already)
    docs = sorted((f"doc{i:04d}.md" for i in range(DOCS)), key=_bucket)
    edited = [docs[0], docs[-1]]
    for doc in edited:
        (corpus / doc).write_text(f"# {doc}\n\nedited far apart, to be served by one run\n")
    tick = _tick(defs, instance, first_tick.cursor)
    (request,) = tick.run_requests
    keys = requested_keys(instance, request)
    assert request.tags[PENDING_TAG] == f"{_bucket(edited[0])},{_bucket(edited[1])}" and len(keys) > 2
    return tick, edited, keys, after_sync.cursor


def test_an_edit_is_synced_and_embedded_by_the_one_run_the_sensor_requests(corpus, conn, fake, instance, monkeypatch):
    defs = fresh_defs()
    tick, edited, keys, after_sync = _edited_far_apart(defs, instance, corpus)
    (request,) = tick.run_requests
    billed = fake.stats["billed_inputs"]
    stated = _stated(monkeypatch)
    grouped_reads = _grouped_coverage_reads(monkeypatch)

    result = defs.resolve_job_def(request.job_name).execute_in_process(  # that run alone, nothing chained
        instance=instance, partition_key=request.partition_key, tags=_run_tags(request), raise_on_error=False
    )
    assert result.success
    assert stated == []  # no walk: the tick has just observed the source
    for doc in edited:  # served: the new text, a vector for every chunk of it
        text, chunks, vectors = served(conn, doc, MODEL_ID)
        assert "to be served by one run" in text and chunks == vectors > 0, (doc, chunks, vectors)
    assert fake.stats["billed_inputs"] == billed + 2  # the two edited chunks, nothing else
    # No second run for it, and the next tick finds nothing to do.
    assert not evaluate_sensor(embed_after_sync, defs, instance, after_sync).run_requests
    assert "no change" in _tick(defs, instance, tick.cursor).skip_message

    # What it recorded: the two edited buckets' documents, chunks and embeddings cells, from this
    # run, each FRESH, and one passing coverage evaluation per cell; the rest of the range keeps
    # what the first run recorded (and is as FRESH as it was).
    changed = [bucket_key(_bucket(d)) for d in edited]
    for asset in ("documents", "chunks", "embeddings"):
        latest = latest_materializations(instance, asset, keys)
        assert sorted(k for k, r in latest.items() if r.run_id == result.run_id) == changed, asset
        assert stale_status(defs, instance, asset, keys) == {k: "FRESH" for k in keys}, asset
    checks = result.get_asset_check_evaluations()
    assert sorted(e.partition.split("|")[0] for e in checks) == changed and all(e.passed for e in checks)
    # The checks judge what the cells record (one snapshot), without a second read over the buckets.
    recorded = {
        m.partition: {k: m.metadata[k].value for k in ("chunks", "ready", "failed", "waiting")}
        for m in result.asset_materializations_for_node(sync_and_embed.EMBED_OP)
    }
    assert {e.partition: {k: e.metadata[k].value for k in recorded[e.partition]} for e in checks} == recorded
    assert grouped_reads == []


def test_a_bucket_is_not_fresh_before_its_vectors_nor_after_a_change_seen_during_the_run(
    corpus, conn, fake, instance, monkeypatch
):
    defs = fresh_defs()
    tick, edited, _, _ = _edited_far_apart(defs, instance, corpus)
    (request,) = tick.run_requests
    low, high = (bucket_key(_bucket(d)) for d in edited)
    seen: dict[str, dict[str, str]] = {}
    real = sync_and_embed.embed_or_fail

    def between(*args, **kwargs):
        """Between the sync and the embeddings: what the UI shows, then a new change to ``high``."""
        for asset in ("documents", "embeddings"):
            seen[asset] = stale_status(defs, instance, asset, [low, high])
        instance.report_runless_asset_event(
            dg.AssetObservation(SOURCE_FILES, partition=high, tags={DATA_VERSION_TAG: "g99:edited-again"})
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(sync_and_embed, "embed_or_fail", between)
    assert (
        defs.resolve_job_def(request.job_name)
        .execute_in_process(instance=instance, partition_key=request.partition_key, tags=_run_tags(request))
        .success
    )
    assert seen == {
        "documents": {low: "FRESH", high: "FRESH"},
        "embeddings": {low: "STALE", high: "STALE"},  # synced, not embedded yet
    }
    # The run embedded both, but ``high`` changed after its sync read the source: never FRESH.
    for asset in ("documents", "chunks", "embeddings"):
        assert stale_status(defs, instance, asset, [low, high]) == {low: "FRESH", high: "STALE"}, asset


def test_a_range_run_of_sync_documents_walks_and_syncs_every_bucket(corpus, conn, fake, instance, monkeypatch):
    defs = fresh_defs()
    _edited_far_apart(defs, instance, corpus)  # the first run, and two edits the sensor has seen
    docs = sorted((f"doc{i:04d}.md" for i in range(DOCS)), key=_bucket)
    first, last, between = docs[0], docs[-1], docs[len(docs) // 2]
    # Edited behind the sensor's back (no tick): a "Materialize" of the range finds it itself.
    (corpus / between).write_text("# between\n\nedited without a tick\n")
    stated = _stated(monkeypatch)
    keys = [bucket_key(b) for b in range(_bucket(first), _bucket(last) + 1)]
    result = execute(defs, instance, job="sync_documents", tags=range_tags(keys))
    assert result.success
    assert set(stated) == set(docs)  # the range spans every document's bucket
    assert "edited without a tick" in served(conn, between, MODEL_ID)[0]
    assert all("to be served by one run" in served(conn, doc, MODEL_ID)[0] for doc in (first, last))
    run_meta = {k: v.value for k, v in result.asset_materializations_for_node("ingest")[0].metadata.items()}
    assert run_meta["walked_source"] is True and run_meta["partitions"] == len(keys)
