"""Reconciliation in Dagster's picture: an asset whose changes show up as materializations of the
buckets they fall in, and the sensors that request it (dead-letter growth, a failed run)."""

from __future__ import annotations

import os
import time

import dagster as dg
import pytest

from pipeline_assets.app import buckets as bk
from pipeline_assets.defs.keys import RECONCILIATION
from pipeline_assets.defs.partitions import bucket_key
from pipeline_assets.defs.reconcile.jobs import RECONCILE_JOB_NAME
from pipeline_assets.store import reports
from pipeline_assets_tests.dagster_helpers import (
    bucket_of,
    evaluate_sensor,
    execute,
    fresh_defs,
    latest_materializations,
    range_tags,
    stale_status,
    watched_corpus,
)
from pipeline_assets_tests.data_helpers import job_counts

KEYS = [f"doc{i:04d}.md" for i in range(4)]
NEW_DOC = "doc0009.md"


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    return watched_corpus(tmp_path / "corpus", len(KEYS), monkeypatch)


def _reconciliations(instance: dg.DagsterInstance) -> list[dict]:
    """The metadata of every reconciliation materialization, oldest first."""
    records = instance.fetch_materializations(RECONCILIATION, limit=100, ascending=True).records
    return [{k: v.value for k, v in r.asset_materialization.metadata.items()} for r in records]


def _span(docs: list[str]) -> list[str]:
    """Every bucket key from the lowest to the highest bucket of some documents."""
    indexes = sorted(bk.bucket_of(d, 64) for d in docs)
    return [bucket_key(i) for i in range(indexes[0], indexes[-1] + 1)]


def _metadata(record: dg.EventLogRecord) -> dict:
    return {k: v.value for k, v in record.asset_materialization.metadata.items()}


def test_reconciliation_shows_what_it_added_changed_and_tombstoned(corpus, conn, fake, monkeypatch):
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    # One run over the buckets of doc0000..doc0002; doc0003's bucket lies outside it (never ingested).
    run = _span(KEYS[:3])
    assert bucket_of(KEYS[3]) not in run and bucket_of(NEW_DOC) not in run
    ingest = execute(defs, instance, tags=range_tags(run))
    assert ingest.success
    root = str(corpus.resolve())
    assert sorted(reports.document_summaries(conn, root, KEYS)) == KEYS[:3]
    # Behind Dagster's back: an edit, a deletion, a new file; doc0003 was never materialized at all.
    (corpus / KEYS[1]).write_text("# changed\n\nentirely new words for this document\n")
    (corpus / KEYS[2]).unlink()
    (corpus / NEW_DOC).write_text("# new\n\na document nobody told Dagster about\n")
    changed = {KEYS[1]: "changed", KEYS[2]: "tombstoned", KEYS[3]: "new", NEW_DOC: "new"}
    touched = {bucket_of(d): d for d in changed}
    assert len(touched) == len(changed)  # one document per bucket here (asserted: the buckets are a hash)
    untouched = bucket_of(KEYS[0])

    result = execute(defs, instance, job=RECONCILE_JOB_NAME)
    assert result.success
    (meta,) = _reconciliations(instance)
    assert (meta["new"], meta["changed"], meta["deleted"]) == (2, 1, 1)
    assert (meta["buckets_reported"], meta["documents_reported"]) == (4, 4)
    assert meta["enqueued"] > 0 and isinstance(meta["duration_seconds"], float)
    summaries = reports.document_summaries(conn, root, [*KEYS, NEW_DOC])
    assert summaries[KEYS[2]].status == "deleted"
    assert all(summaries[d].status == "current" for d in (KEYS[0], KEYS[1], KEYS[3], NEW_DOC))

    # Each bucket it touched has a documents and a chunks materialization of the reconciliation run,
    # naming the document it changed, with the bucket's counts; nothing else does, and embeddings
    # gets nothing (its jobs are only enqueued).
    for asset in ("documents", "chunks"):
        latest = latest_materializations(instance, asset, [*touched, untouched, *run])
        by_reconcile = {k for k, r in latest.items() if r.run_id == result.run_id}
        assert by_reconcile == set(touched), asset
        for key, doc in touched.items():
            m = _metadata(latest[key])
            assert (m["reported_by"], m["changed_documents"], m["changed_count"]) == ("reconciliation", doc, 1)
    documents = latest_materializations(instance, "documents", list(touched))
    chunks = latest_materializations(instance, "chunks", list(touched))
    assert _metadata(documents[bucket_of(KEYS[2])])["documents"] == 0  # its only document is gone
    for doc in (KEYS[1], KEYS[3], NEW_DOC):
        key = bucket_of(doc)
        assert (_metadata(documents[key])["documents"], _metadata(documents[key])["current"]) == (1, 1)
        assert _metadata(chunks[key])["chunk_count"] == summaries[doc].chunks > 0
    assert not [e for e in result.get_asset_materialization_events() if e.asset_key == dg.AssetKey("embeddings")]
    # What Dagster now shows is true: the buckets whose content changed need embedding, the new
    # documents' buckets were never embedded, the untouched one is fresh; documents and chunks are
    # current everywhere.
    assert stale_status(defs, instance, "embeddings", [untouched, *touched]) == {
        untouched: "FRESH",
        bucket_of(KEYS[1]): "STALE",
        bucket_of(KEYS[2]): "STALE",
        bucket_of(KEYS[3]): "MISSING",
        bucket_of(NEW_DOC): "MISSING",
    }
    assert set(stale_status(defs, instance, "chunks", list(touched)).values()) == {"FRESH"}
    # Its events carry the buckets' code versions: after a parser fix, the buckets it reported are
    # stale like the others (Dagster compares code versions, not timestamps).
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-2")
    assert set(stale_status(fresh_defs(), instance, "documents", [untouched, *touched]).values()) == {"STALE"}
    monkeypatch.delenv("PIPELINE_EXTRACTOR_VERSION")

    # The digests it reported are the buckets' own: a one-bucket run of the new document's bucket
    # (nothing changed since) records exactly them as its data versions, and embeds it.
    key = bucket_of(NEW_DOC)
    reported = _metadata(documents[key]), _metadata(chunks[key])
    settled = time.time() - 3600  # as a file is by the next run on a busy machine (not "just modified")
    os.utime(corpus / NEW_DOC, (settled, settled))
    assert execute(defs, instance, partition_key=key).success
    after = (
        latest_materializations(instance, "documents", [key])[key],
        latest_materializations(instance, "chunks", [key])[key],
    )
    assert after[0].asset_materialization.tags["dagster/data_version"] == reported[0]["text_digest"]
    assert after[1].asset_materialization.tags["dagster/data_version"] == reported[1]["chunks_digest"]
    # The reconciliation had ingested these bytes already: the run extracts nothing. (The scan lists
    # a settled file it has no observation of without reading it; the run reads it once, finds the
    # bytes the reconciliation stored, and records their checksum as synced.)
    ran = _metadata(after[0])
    assert (ran["changed_documents"], ran["new"], ran["changed"], ran["unchanged"]) == (1, 0, 0, 1)
    assert stale_status(defs, instance, "embeddings", [key]) == {key: "FRESH"}

    # Nothing changed since: a second run reports nothing, and its counts line up run over run.
    assert execute(defs, instance, job=RECONCILE_JOB_NAME).success
    first, second = _reconciliations(instance)
    assert second["new"] == second["changed"] == second["deleted"] == second["buckets_reported"] == 0
    numeric = {k for k, v in first.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert {"new", "changed", "deleted", "enqueued", "superseded", "rescued", "buckets_reported"} <= numeric


def test_dead_letter_growth_past_the_threshold_requests_a_reconciliation(corpus, conn, fake, instance, monkeypatch):
    monkeypatch.setenv("PIPELINE_DLQ_GROWTH_PER_HOUR", "2")
    defs = fresh_defs()
    sensor = defs.resolve_sensor_def("reconcile_on_dead_letters")
    assert execute(defs, instance, tags=range_tags(_span(KEYS))).success
    assert job_counts(conn)["ready"] >= 4

    def fail(n: int) -> None:
        conn.execute(
            """UPDATE app.embedding_jobs SET status = 'failed', error_class = 'bad_input', updated_at = now()
                        WHERE job_id IN (SELECT job_id FROM app.embedding_jobs WHERE status = 'ready'
                                         ORDER BY job_id LIMIT %s)""",
            (n,),
        )

    fail(2)  # at the threshold: no reconciliation
    quiet = evaluate_sensor(sensor, defs, instance)
    assert not quiet.run_requests and "2 job(s) failed in the last hour (threshold 2/h)" in quiet.skip_message
    fail(1)  # past it: one request
    data = evaluate_sensor(sensor, defs, instance, cursor=quiet.cursor)
    (request,) = data.run_requests
    assert sensor.job_name == RECONCILE_JOB_NAME and request.tags["pipeline/trigger"] == "dead_letters"
    again = evaluate_sensor(sensor, defs, instance, cursor=data.cursor)  # no new failure: not again
    assert not again.run_requests and "no new failure" in again.skip_message
    fail(1)
    assert len(evaluate_sensor(sensor, defs, instance, cursor=again.cursor).run_requests) == 1

    result = execute(defs, instance, request, job=RECONCILE_JOB_NAME)
    assert result.success and len(_reconciliations(instance)) == 1


def test_a_failed_run_requests_a_reconciliation(corpus, conn, fake, instance):
    defs = fresh_defs()
    sensor = defs.resolve_sensor_def("reconcile_on_run_failure")
    first = evaluate_sensor(sensor, defs, instance)  # starts watching from now
    assert not first.run_requests
    # An embeddings run that fails: no external worker comes before its deadline.
    chain = execute(
        defs,
        instance,
        partition_key=bucket_of(KEYS[0]),
        run_config={"resources": {"embedding_run": {"config": {"in_process": False, "deadline_seconds": 0.5}}}},
    )
    synced, failed = chain.results
    assert synced.success and not failed.success
    data = evaluate_sensor(sensor, defs, instance, cursor=first.cursor)
    (request,) = data.run_requests
    assert request.job_name in (None, RECONCILE_JOB_NAME) and request.tags["pipeline/failed_run"] == failed.run_id
    # A repair of the job table: no source file is read (a failed run's files are the source sensor's retry).
    assert request.run_config == {"ops": {"reconciliation": {"config": {"rescan": False}}}}
    (corpus / KEYS[1]).write_text("# changed\n\nan edit the repair must not re-ingest\n")
    before = conn.execute("SELECT document_id, source_checksum FROM app.documents ORDER BY 1").fetchall()
    repaired = defs.resolve_job_def(RECONCILE_JOB_NAME).execute_in_process(
        instance=instance, run_config=request.run_config, tags=request.tags, raise_on_error=False
    )
    assert repaired.success
    assert _reconciliations(instance)[-1]["sources"] == 0
    assert conn.execute("SELECT document_id, source_checksum FROM app.documents ORDER BY 1").fetchall() == before
    # A failed reconciliation does not request another one.
    instance.report_run_failed(instance.create_run_for_job(defs.resolve_job_def(RECONCILE_JOB_NAME)))
    later = evaluate_sensor(sensor, defs, instance, cursor=data.cursor)
    assert not later.run_requests
    # Runs failing again and again: at most one repair per RUN_FAILURE_RECONCILE_INTERVAL_SECONDS.
    for _ in range(3):
        instance.report_run_failed(instance.create_run_for_job(defs.resolve_job_def("embed_documents")))
        later = evaluate_sensor(sensor, defs, instance, cursor=later.cursor)
        assert not later.run_requests and "at most one per 600 s" in later.skip_message
