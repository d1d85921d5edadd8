"""A model change through Dagster (issue 9 section 4, issue 10): the model_switch sensor
registers the newly configured model, search stays on the old one until the new one
covers the corpus, then the sensor serves it and retires the old one; every step is an
observation in the instance's event log. A launchpad override of the model is refused."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app import model_admin
from pipeline_assets.app import search as search_uc
from pipeline_assets.defs.definitions import build_definitions
from pipeline_assets.defs.model_switch import EMBEDDING_STORE, model_switch_sensor
from pipeline_assets.defs.partitions import bucket_key
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.jobs import models
from pipeline_assets.settings import Settings
from pipeline_assets.store import db
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.dagster_helpers import (
    bucket_of,
    evaluate_sensor,
    execute,
    fresh_defs,
    postgres_instance,
    range_tags,
    stale_status,
    watched_corpus,
)

OLD, NEW_NAME = f"openai/{FAKE_MODEL}", "fake-embed-2"
NEW = f"openai/{NEW_NAME}"
KEYS = [f"doc{i:04d}.md" for i in range(4)]
# Their buckets: doc0001 b013, doc0002 b018, doc0000 b041, doc0003 b045 (asserted in the test). The old
# model embeds one range over all four; the new one two halves, one range each.
ALL = [bucket_key(i) for i in range(13, 46)]
FIRST, SECOND = [bucket_key(i) for i in range(13, 19)], [bucket_key(i) for i in range(41, 46)]


@pytest.fixture
def corpus(env, clean_db, tmp_path, monkeypatch):
    return watched_corpus(tmp_path / "corpus", len(KEYS), monkeypatch)


def tick(defs, instance, cursor):
    """One evaluation as the daemon runs it, its asset events written to the event log."""
    data = evaluate_sensor(model_switch_sensor, defs, instance, cursor=cursor)
    for event in data.asset_events:
        instance.report_runless_asset_event(event)
    return data


def served_search() -> str:
    """What `pipeline-assets search` does: embed the query with the served model, read its vectors."""
    settings = Settings.from_env()
    with db.make_pool(db.database_url(settings), max_size=2) as pool:
        rt = model_admin.served_runtime(settings, pool)
        hits = search_uc.search(rt, pool, "w1 w8 w15", 3, mode="vector")
    assert len(hits) == 3
    return rt.model_id


def observed_events(instance) -> list[dict]:
    records = instance.fetch_observations(EMBEDDING_STORE, limit=20, ascending=True).records
    return [{k: v.value for k, v in r.asset_observation.metadata.items()} for r in records]


def test_a_model_change_is_served_only_once_the_new_model_covers_the_corpus(corpus, conn, fake, monkeypatch,
                                                                          server_url):
    with postgres_instance(server_url) as instance:
        _switch(instance, conn, monkeypatch)


def _switch(instance, conn, monkeypatch) -> None:
    buckets = [bucket_of(d) for d in KEYS]
    assert sorted(buckets) == [FIRST[0], FIRST[-1], SECOND[0], SECOND[-1]]
    old_defs = fresh_defs()
    assert execute(old_defs, instance, tags=range_tags(ALL)).success
    first = tick(old_defs, instance, None)
    assert first.cursor == f"served:{OLD}" and "serving the configured model" not in (first.skip_message or "")
    assert tick(old_defs, instance, first.cursor).skip_message == f"serving the configured model {OLD}"
    wanted = models.coverage(conn, OLD).wanted

    # PIPELINE_EMBEDDING_MODEL changes and the code location reloads.
    monkeypatch.setenv("PIPELINE_EMBEDDING_MODEL", NEW_NAME)
    defs = fresh_defs()
    assert set(stale_status(defs, instance, "embeddings", ALL).values()) == {"STALE"}   # a new code version
    assert set(stale_status(defs, instance, "chunks", ALL).values()) == {"FRESH"}       # the model is not theirs
    added = tick(defs, instance, first.cursor)
    assert added.cursor == NEW
    assert models.coverage(conn, NEW).waiting == wanted     # jobs for every current chunk
    assert served_search() == OLD

    # A launchpad override of the model would record the old model's vectors under the new code version.
    override = defs.resolve_job_def("embed_documents").execute_in_process(
        instance=instance, partition_key=buckets[0], raise_on_error=False,
        run_config={"resources": {"embedding_provider": {"config": {"model": FAKE_MODEL}}}})
    assert not override.success
    [failure] = [e for e in override.all_events if e.is_step_failure]
    assert failure.step_key == "ingest"     # refused by the resource, before anything is registered or embedded
    assert f"the run's model {OLD} is not the configured model {NEW}" in failure.step_failure_data.error.to_string()
    # Definitions whose code version is not the run's model (assets and resources built from other
    # settings): embeddings refuses.
    assets_of = build_definitions(Settings.from_env().replace(embedding_model="fake-embed-3"))
    other = dg.Definitions(assets=assets_of.assets, jobs=assets_of.jobs, executor=assets_of.executor,
                           resources=build_resources(Settings.from_env()))
    mismatch = execute(other, instance, partition_key=buckets[0])
    [failure] = [e for e in mismatch.all_events if e.is_step_failure]
    assert failure.step_key == "embeddings"
    assert "is not the code version of embeddings" in failure.step_failure_data.user_failure_data.description
    assert models.coverage(conn, NEW).ready == 0

    # The buckets of half the documents embedded with the new model: search stays on the old one.
    assert execute(defs, instance, tags=range_tags(FIRST)).success
    half = models.coverage(conn, NEW)
    assert 0 < half.ready < half.wanted
    with_new = conn.execute("""SELECT DISTINCT d.document_id FROM app.documents d
                               JOIN app.chunks c ON c.doc_pk = d.doc_pk
                               JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %s
                               ORDER BY 1""", (NEW,)).fetchall()
    assert [r[0] for r in with_new] == sorted(d for d in KEYS if bucket_of(d) in FIRST)
    waiting = tick(defs, instance, added.cursor)
    assert waiting.skip_message.startswith(f"serving {OLD} until {NEW} covers the corpus: {half.ready}/{wanted}")
    assert served_search() == OLD
    assert models.served_model_id(conn) == OLD

    # The rest: the next tick serves the new model and retires the old one.
    assert execute(defs, instance, tags=range_tags(SECOND)).success
    assert served_search() == OLD                              # nothing switches between ticks
    assert waiting.cursor == NEW                               # the switch is still pending
    switched = tick(defs, instance, waiting.cursor)
    assert switched.cursor == f"served:{NEW}"
    assert models.served_model_id(conn) == NEW and served_search() == NEW
    assert "model_served" in switched.skip_message
    [(active, retired_at)] = conn.execute("SELECT active, retired_at FROM app.models WHERE model_id = %s",
                                          (OLD,)).fetchall()
    assert not active and retired_at is not None
    # The old model's work is over (nothing waits for a worker that never comes); its vectors stay for the grace.
    assert conn.execute("SELECT count(*) FROM app.embedding_jobs WHERE model_id = %s AND status IN "
                        "('pending', 'retry', 'processing')", (OLD,)).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM app.embeddings WHERE model_id = %s", (OLD,)).fetchone()[0] == wanted
    assert set(stale_status(defs, instance, "embeddings", [*FIRST, *SECOND]).values()) == {"FRESH"}
    # The buckets between the two runs were not re-run: the UI still says they need the new model
    # (they hold no document here; a backfill of the stale partitions would clear them).
    assert set(stale_status(defs, instance, "embeddings", ALL[len(FIRST):-len(SECOND)]).values()) == {"STALE"}
    assert tick(defs, instance, switched.cursor).skip_message == f"serving the configured model {NEW}"

    # A rollback by hand is not overruled: the configured model was served once already.
    settings = Settings.from_env()
    with db.make_pool(db.database_url(settings), max_size=2) as pool:
        model_admin.activate(pool, FAKE_MODEL, max_attempts=settings.max_attempts)
        assert model_admin.serve(pool, FAKE_MODEL)["previous"] == NEW
    left = tick(defs, instance, switched.cursor)
    assert left.skip_message.startswith(f"serving {OLD}, served by hand after the configured {NEW} was")
    assert models.served_model_id(conn) == OLD and served_search() == OLD

    events = observed_events(instance)   # three: the hand-made rollback is not the sensor's event
    assert [(e["event"], e["model"], e["served_model"]) for e in events] == [
        ("model_configured", OLD, OLD), ("model_configured", NEW, OLD), ("model_served", NEW, NEW)]
    assert events[1]["newly_registered"] is True and events[1]["enqueued"] == wanted
    assert events[1]["previous_configured"] == OLD
    assert events[2]["previous_model"] == OLD and events[2]["retired_model"] == OLD
    assert events[2]["coverage_ready"] == events[2]["coverage_wanted"] == wanted
