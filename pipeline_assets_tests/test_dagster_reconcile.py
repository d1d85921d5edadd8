"""Reconciliation in Dagster's picture: an asset whose changes show up as partitions and
materializations, and the sensors that request it (dead-letter growth, a failed run)."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app import reports
from pipeline_assets.defs.reconcile import RECONCILE_JOB_NAME, RECONCILIATION
from pipeline_assets_tests.conftest import job_counts
from pipeline_assets_tests.dagster_helpers import (evaluate_sensor, execute, fresh_defs, latest_data_versions,
                                                   range_tags, stale_status, watched_corpus)

KEYS = [f"doc{i:04d}.md" for i in range(4)]


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    return watched_corpus(tmp_path / "corpus", len(KEYS), monkeypatch)


@pytest.fixture
def instance():
    """A real (temporary, SQLite) instance: sensors need one they can hand to other processes."""
    with dg.instance_for_test() as inst:
        yield inst


def _reconciliations(instance: dg.DagsterInstance) -> list[dict]:
    """The metadata of every reconciliation materialization, oldest first."""
    records = instance.fetch_materializations(RECONCILIATION, limit=100, ascending=True).records
    return [{k: v.value for k, v in r.asset_materialization.metadata.items()} for r in records]


def test_reconciliation_shows_what_it_added_changed_and_tombstoned(corpus, conn, fake):
    defs = fresh_defs()
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("documents", KEYS[:3])
    assert execute(defs, instance, tags=range_tags(KEYS[:3])).success
    # Behind Dagster's back: an edit, a deletion, a new file; doc0003 was never materialized at all.
    (corpus / KEYS[1]).write_text("# changed\n\nentirely new words for this document\n")
    (corpus / KEYS[2]).unlink()
    (corpus / "doc0009.md").write_text("# new\n\na document nobody told Dagster about\n")

    result = execute(defs, instance, job=RECONCILE_JOB_NAME)
    assert result.success
    (meta,) = _reconciliations(instance)
    assert (meta["new"], meta["changed"], meta["deleted"]) == (2, 1, 1)
    assert (meta["partitions_added"], meta["partitions_deleted"], meta["partitions_reported"]) == (2, 1, 3)
    assert meta["enqueued"] > 0 and isinstance(meta["duration_seconds"], float)
    # The partitions are the source's documents again.
    assert sorted(instance.get_dynamic_partitions("documents")) == [KEYS[0], KEYS[1], KEYS[3], "doc0009.md"]
    # Each reported partition's data versions are its own, as an ingest run writes them.
    touched = [KEYS[1], KEYS[3], "doc0009.md"]
    summaries = reports.document_summaries(conn, str(corpus.resolve()), touched)
    assert latest_data_versions(instance, "documents", touched) == {k: summaries[k].text_checksum for k in touched}
    assert latest_data_versions(instance, "chunks", touched) == {k: summaries[k].chunks_digest for k in touched}
    # What Dagster now shows is true: the edited document needs embedding, the new ones were never
    # embedded, the untouched one is fresh; documents and chunks are current everywhere.
    assert stale_status(defs, instance, "embeddings", [KEYS[0], KEYS[1], KEYS[3]]) == {
        KEYS[0]: "FRESH", KEYS[1]: "STALE", KEYS[3]: "MISSING"}
    assert set(stale_status(defs, instance, "chunks", touched).values()) == {"FRESH"}

    # Nothing changed since: a second run reports nothing, and its counts line up run over run.
    assert execute(defs, instance, job=RECONCILE_JOB_NAME).success
    first, second = _reconciliations(instance)
    assert second["new"] == second["changed"] == second["deleted"] == second["partitions_reported"] == 0
    numeric = {k for k, v in first.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert {"new", "changed", "deleted", "enqueued", "superseded", "rescued", "partitions_added"} <= numeric


def test_dead_letter_growth_past_the_threshold_requests_a_reconciliation(corpus, conn, fake, instance, monkeypatch):
    monkeypatch.setenv("PIPELINE_DLQ_GROWTH_PER_HOUR", "2")
    defs = fresh_defs()
    sensor = defs.resolve_sensor_def("reconcile_on_dead_letters")
    instance.add_dynamic_partitions("documents", KEYS)
    assert execute(defs, instance, tags=range_tags(KEYS)).success
    assert job_counts(conn)["ready"] >= 4

    def fail(n: int) -> None:
        conn.execute("""UPDATE app.embedding_jobs SET status = 'failed', error_class = 'bad_input', updated_at = now()
                        WHERE job_id IN (SELECT job_id FROM app.embedding_jobs WHERE status = 'ready'
                                         ORDER BY job_id LIMIT %s)""", (n,))

    fail(2)                                                          # at the threshold: no reconciliation
    quiet = evaluate_sensor(sensor, defs, instance)
    assert not quiet.run_requests and "2 job(s) failed in the last hour (threshold 2/h)" in quiet.skip_message
    fail(1)                                                          # past it: one request
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
    instance.add_dynamic_partitions("documents", KEYS[:1])
    first = evaluate_sensor(sensor, defs, instance)                 # starts watching from now
    assert not first.run_requests
    # An embeddings run that fails: no external worker comes before its deadline.
    failed = defs.resolve_job_def("embed_documents").execute_in_process(
        instance=instance, partition_key=KEYS[0], raise_on_error=False,
        run_config={"resources": {"embedding_run": {"config": {"in_process": False, "deadline_seconds": 0.5}}}})
    assert not failed.success
    data = evaluate_sensor(sensor, defs, instance, cursor=first.cursor)
    (request,) = data.run_requests
    assert request.job_name in (None, RECONCILE_JOB_NAME) and request.tags["pipeline/failed_run"] == failed.run_id
    assert execute(defs, instance, request, job=RECONCILE_JOB_NAME).success
    # A failed reconciliation does not request another one.
    instance.report_run_failed(instance.create_run_for_job(defs.resolve_job_def(RECONCILE_JOB_NAME)))
    later = evaluate_sensor(sensor, defs, instance, cursor=data.cursor)
    assert not later.run_requests
