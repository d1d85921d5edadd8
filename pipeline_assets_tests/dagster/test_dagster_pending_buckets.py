"""The source sensor's run over a range of buckets works on the buckets its tick found pending
(no walk of the source, their files only) and records the rest of its range as it is, truthfully;
a range run without the sensor's tag (the UI's "Materialize", a backfill) still syncs every bucket."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app import buckets as bk
from pipeline_assets.content import folder_source
from pipeline_assets.defs.embeddings.sensors import embed_after_sync
from pipeline_assets.defs.ingest.source_sensor import source_documents_sensor
from pipeline_assets.defs.partitions import bucket_key
from pipeline_assets.defs.run_requests import PENDING_TAG
from pipeline_assets.store import bucket_rows
from pipeline_assets_tests.conftest import write_corpus
from pipeline_assets_tests.dagster_helpers import (
    EMBED_JOB,
    SYNC_JOB,
    configured_model,
    embed_range_tags,
    evaluate_sensor,
    execute,
    fresh_defs,
    postgres_instance,
    range_tags,
    requested_keys,
    stale_status,
)

N = 64
DOCS = 40


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    write_corpus(root, DOCS)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    clean_db.execute("TRUNCATE app.source_observations")
    return root


@pytest.fixture
def instance(server_url):
    with postgres_instance(server_url) as inst:
        yield inst


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


def _pending(request: dg.RunRequest) -> dict[str, str]:
    return {PENDING_TAG: request.tags[PENDING_TAG]}


def _tick(defs, instance, cursor: str | None = None):
    """A source sensor tick, its observations of ``source_files`` recorded as the daemon records them."""
    return evaluate_sensor(source_documents_sensor, defs, instance, cursor, record_events=True)


def _bucket(doc: str) -> int:
    return bk.bucket_of(doc, N)


def _ends(docs: list[str]) -> tuple[str, str, list[str]]:
    """The documents in the lowest and the highest bucket, and those strictly between them."""
    ordered = sorted(docs, key=_bucket)
    first, last = ordered[0], ordered[-1]
    between = [d for d in ordered if _bucket(first) < _bucket(d) < _bucket(last)]
    return first, last, between


def _text(conn, doc: str) -> str:
    return conn.execute(
        "SELECT coalesce(string_agg(c.text, ''), '') FROM app.chunks c JOIN app.documents d USING (doc_pk) "
        "WHERE d.document_id = %s AND d.status = 'current'",
        (doc,),
    ).fetchone()[0]


def _partition_metadata(result: dg.ExecuteInProcessResult, asset: str) -> dict[str, dict]:
    return {
        e.partition: {k: v.value for k, v in e.metadata.items()}
        for e in result.asset_materializations_for_node("ingest")
        if e.asset_key == dg.AssetKey(asset)
    }


def _synced(defs, instance, corpus) -> str:
    """The first tick's run (every bucket, in full) and its embeddings run; the tick's cursor."""
    tick = _tick(defs, instance)
    (request,) = tick.run_requests
    assert PENDING_TAG not in request.tags  # the first request syncs every bucket in full
    assert execute(defs, instance, request).success
    return tick.cursor


def _sync_only(defs, instance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """The sync run a request describes, alone (its embeddings run is the sensor's: ``_embed_after``)."""
    return defs.resolve_job_def(SYNC_JOB).execute_in_process(
        instance=instance, tags=dict(request.tags), partition_key=request.partition_key, raise_on_error=False
    )


def _embed_after(defs, instance, sync_run_id: str) -> dg.ExecuteInProcessResult:
    """The embeddings run embed_after_sync requests after the sync run (its tags as it has them)."""
    tick = evaluate_sensor(embed_after_sync, defs, instance)
    (request,) = tick.run_requests
    assert request.tags["pipeline/after_run"] == sync_run_id
    result = execute(defs, instance, request, job=EMBED_JOB)
    assert result.success
    return result


def test_a_sensor_range_run_syncs_only_its_pending_buckets(corpus, conn, fake, instance, monkeypatch):
    defs = fresh_defs()
    cursor = _synced(defs, instance, corpus)
    docs = [f"doc{i:04d}.md" for i in range(DOCS)]
    first, last, between = _ends(docs)
    assert len({_bucket(d) for d in between}) >= 5  # a range with many unchanged buckets inside
    for doc in (first, last):
        (corpus / doc).write_text(f"# {doc}\n\nedited far apart\n")
    tick = _tick(defs, instance, cursor)
    (request,) = tick.run_requests
    keys = requested_keys(instance, request)
    assert keys == [bucket_key(b) for b in range(_bucket(first), _bucket(last) + 1)]
    assert request.tags[PENDING_TAG] == f"{_bucket(first)},{_bucket(last)}"
    # A re-evaluated tick (its cursor not saved) asks for the same run, tags and all.
    (replay,) = _tick(defs, instance, cursor).run_requests
    assert (replay.run_key, replay.tags) == (request.run_key, request.tags)

    stated = _stated(monkeypatch)
    billed = fake.stats["billed_inputs"]
    synced = _sync_only(defs, instance, request)
    assert synced.success
    assert stated == []  # no walk: the tick has just observed the source
    assert "edited far apart" in _text(conn, first) and "edited far apart" in _text(conn, last)
    run_meta = {k: v.value for k, v in synced.asset_materializations_for_node("ingest")[0].metadata.items()}
    assert run_meta["changed_documents"] == 2 and run_meta["synced_buckets"] == 2
    assert run_meta["walked_source"] is False
    # Every bucket of the range is materialized, each with its own current rows.
    root = str(corpus.resolve())
    with conn.transaction():
        states = bucket_rows.states_of(conn, root, [bk.bucket_of(d, N) for d in docs], N)
    documents = _partition_metadata(synced, "documents")
    assert sorted(documents) == keys
    for key, meta in documents.items():
        state = states.get(int(key[1:]), bucket_rows.BucketState())
        assert (meta["documents"], meta["current"]) == (state.documents, state.current)
        assert meta["text_digest"] == (state.text_digest or bucket_rows.digest([]))
    assert stale_status(defs, instance, "documents", keys) == {k: "FRESH" for k in keys}

    embedded = _embed_after(defs, instance, synced.run_id)
    assert fake.stats["billed_inputs"] == billed + 2  # the two edited chunks, nothing else
    meta = {k: v.value for k, v in embedded.asset_materializations_for_node("embeddings")[0].metadata.items()}
    assert meta["waited_buckets"] == 2 and meta["partitions"] == len(keys)
    checks = embedded.get_asset_check_evaluations()
    assert len(checks) == len(keys) and all(e.passed for e in checks)
    assert stale_status(defs, instance, "embeddings", keys) == {k: "FRESH" for k in keys}


def test_a_sensor_run_also_syncs_a_file_waiting_out_its_backoff_in_its_range(corpus, conn, fake, instance):
    defs = fresh_defs()
    cursor = _synced(defs, instance, corpus)
    docs = [f"doc{i:04d}.md" for i in range(DOCS)]
    first, last, between = _ends(docs)
    middle = between[len(between) // 2]
    # The middle file's run is cancelled: its file waits out a backoff (not pending).
    (corpus / middle).write_text("# middle\n\nedited first\n")
    tick = _tick(defs, instance, cursor)
    (request,) = tick.run_requests
    run = instance.create_run_for_job(defs.resolve_job_def(SYNC_JOB), tags=request.tags)
    instance.report_run_canceled(instance.get_run_by_id(run.run_id))
    cursor = tick.cursor
    waiting = _tick(defs, instance, cursor)
    assert not waiting.run_requests and "requested again in" in waiting.skip_message
    cursor = waiting.cursor or cursor
    assert stale_status(defs, instance, "documents", [bucket_key(_bucket(middle))]) == {
        bucket_key(_bucket(middle)): "STALE"
    }
    for doc in (first, last):
        (corpus / doc).write_text(f"# {doc}\n\nedited far apart\n")
    tick = _tick(defs, instance, cursor)
    (request,) = tick.run_requests
    assert request.tags[PENDING_TAG] == f"{_bucket(first)},{_bucket(last)}"
    billed = fake.stats["billed_inputs"]
    synced = _sync_only(defs, instance, request)
    assert synced.success
    # Inside the range, the waiting file is synced as a full run syncs it (its bucket is not
    # recorded fresh without it), and the run's tag names its bucket for the embeddings run.
    assert "edited first" in _text(conn, middle)
    tagged = instance.get_run_by_id(synced.run_id).tags[PENDING_TAG]
    assert tagged == ",".join(str(b) for b in sorted({_bucket(first), _bucket(last), _bucket(middle)}))
    keys = requested_keys(instance, request)
    # An embeddings run tagged with the first and last buckets only (as one requested before the
    # sync run named the middle one) waits on the middle bucket too: its chunk is outstanding.
    model = configured_model()
    early = execute(defs, instance, job=EMBED_JOB, tags={**embed_range_tags(keys, [model]), **_pending(request)})
    assert early.success
    assert fake.stats["billed_inputs"] == billed + 3
    meta = {k: v.value for k, v in early.asset_materializations_for_node("embeddings")[0].metadata.items()}
    assert meta["waited_buckets"] == 3 and meta["embedded"] == 3
    assert all(e.passed for e in early.get_asset_check_evaluations())
    # The sensor's embeddings run (the extended tag): nothing left to send.
    embedded = _embed_after(defs, instance, synced.run_id)
    assert fake.stats["billed_inputs"] == billed + 3
    meta = {k: v.value for k, v in embedded.asset_materializations_for_node("embeddings")[0].metadata.items()}
    assert meta["waited_buckets"] == 3
    assert all(e.passed for e in embedded.get_asset_check_evaluations())
    for asset in ("documents", "chunks", "embeddings"):
        assert stale_status(defs, instance, asset, keys) == {k: "FRESH" for k in keys}


def test_a_range_run_without_the_sensor_tag_walks_and_syncs_every_bucket(corpus, conn, fake, instance, monkeypatch):
    defs = fresh_defs()
    _synced(defs, instance, corpus)
    docs = [f"doc{i:04d}.md" for i in range(DOCS)]
    first, last, between = _ends(docs)
    # Edited behind the sensor's back (no tick): a "Materialize" of the range finds it itself.
    (corpus / between[0]).write_text("# between\n\nedited without a tick\n")
    stated = _stated(monkeypatch)
    keys = [bucket_key(b) for b in range(_bucket(first), _bucket(last) + 1)]
    result = execute(defs, instance, job=SYNC_JOB, tags=range_tags(keys))
    assert result.success
    assert set(stated) == {d for d in docs if _bucket(first) <= _bucket(d) <= _bucket(last)}
    assert "edited without a tick" in _text(conn, between[0])
    run_meta = {k: v.value for k, v in result.asset_materializations_for_node("ingest")[0].metadata.items()}
    assert run_meta["walked_source"] is True and run_meta["synced_buckets"] == len(keys)
