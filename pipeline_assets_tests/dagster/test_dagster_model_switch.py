"""A model change through Dagster: embeddings are partitioned by bucket x model. The
model_switch sensor registers the newly configured model and gives it its column (a
dynamic partition key), the column is backfilled (only content without a vector for
it is sent; a bucket run is followed by one embeddings run over every active model),
search stays on the old model until the new one covers the corpus, then the sensor
serves it and retires the old one, whose column leaves the partitions; every step is
an observation in the instance's event log. A launchpad override of the model is refused."""

from __future__ import annotations

import dagster as dg
import pytest

from pipeline_assets.app import model_admin, model_runtime
from pipeline_assets.app import search as search_uc
from pipeline_assets.defs.embeddings.sensors import AFTER_RUN_TAG, chains, embed_after_sync, embed_request
from pipeline_assets.defs.keys import CHUNKS, DOCUMENTS, EMBEDDINGS
from pipeline_assets.defs.models.sensors import EMBEDDING_STORE, model_switch_sensor
from pipeline_assets.defs.partitions import MODEL_PARTITIONS_NAME, bucket_key, embedding_key
from pipeline_assets.registry import models
from pipeline_assets.settings import Settings
from pipeline_assets.store import db
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.dagster_helpers import (
    bucket_of,
    embed_range_tags,
    evaluate_sensor,
    execute,
    fresh_defs,
    latest_materializations,
    range_tags,
    stale_status,
    watched_corpus,
)
from pipeline_assets_tests.dagster_instances import postgres_instance

OLD, NEW_NAME = f"openai/{FAKE_MODEL}", "fake-embed-2"
NEW = f"openai/{NEW_NAME}"
STRAY = "openai/fake-embed-3"
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
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
    return evaluate_sensor(model_switch_sensor, defs, instance, cursor=cursor, record_events=True)


def served_search() -> str:
    """What `pipeline-assets search` does: embed the query with the served model, read its vectors."""
    settings = Settings.from_env()
    with db.make_pool(db.database_url(settings.database_config()), max_size=2) as pool:
        rt = model_runtime.served_runtime(settings, pool)
        hits = search_uc.search(rt, pool, "w1 w8 w15", 3, mode="vector")
    assert len(hits) == 3
    return rt.model_id


def observed_events(instance) -> list[dict]:
    records = instance.fetch_observations(EMBEDDING_STORE, limit=20, ascending=True).records
    return [{k: v.value for k, v in r.asset_observation.metadata.items()} for r in records]


def test_a_model_change_is_served_only_once_the_new_model_covers_the_corpus(
    corpus, conn, fake, monkeypatch, server_url
):
    with postgres_instance(server_url) as instance:
        _switch(instance, conn, fake, monkeypatch)


def _model_keys(instance) -> list[str]:
    return list(instance.get_dynamic_partitions(MODEL_PARTITIONS_NAME))


def _chunk_count(conn, docs) -> int:
    return conn.execute(
        "SELECT count(*) FROM app.chunks c JOIN app.documents d USING (doc_pk) WHERE d.document_id = ANY(%s)",
        (list(docs),),
    ).fetchone()[0]


def _switch(instance, conn, fake, monkeypatch) -> None:
    buckets = [bucket_of(d) for d in KEYS]
    assert sorted(buckets) == [FIRST[0], FIRST[-1], SECOND[0], SECOND[-1]]
    old_defs = fresh_defs()
    assert execute(old_defs, instance, tags=range_tags(ALL)).success
    first = tick(old_defs, instance, None)
    assert first.cursor == f"served:{OLD}" and "serving the configured model" not in (first.skip_message or "")
    assert tick(old_defs, instance, first.cursor).skip_message == f"serving the configured model {OLD}"
    assert _model_keys(instance) == [OLD]  # the registry's active models are the columns
    wanted = models.coverage(conn, OLD).wanted

    # PIPELINE_EMBEDDING_MODEL changes and the code location reloads: the model is a partition, not
    # a code version, so nothing the old model made looks stale.
    monkeypatch.setenv("PIPELINE_EMBEDDING_MODEL", NEW_NAME)
    defs = fresh_defs()
    assert set(stale_status(defs, instance, "embeddings", ALL, OLD).values()) == {"FRESH"}
    assert set(stale_status(defs, instance, "chunks", ALL).values()) == {"FRESH"}
    added = tick(defs, instance, first.cursor)
    assert added.cursor == NEW
    assert models.coverage(conn, NEW).waiting == wanted  # jobs for every current chunk
    assert _model_keys(instance) == [OLD, NEW]  # its column, empty
    assert set(stale_status(defs, instance, "embeddings", ALL, NEW).values()) == {"MISSING"}
    assert served_search() == OLD

    # A launchpad override of the model is refused by the resource, before anything is registered.
    override = defs.resolve_job_def("sync_documents").execute_in_process(
        instance=instance,
        partition_key=buckets[0],
        raise_on_error=False,
        run_config={"resources": {"embedding_provider": {"config": {"model": FAKE_MODEL}}}},
    )
    assert not override.success
    [failure] = [e for e in override.all_events if e.is_step_failure]
    assert failure.step_key == "ingest"
    assert f"the run's model {OLD} is not the configured model {NEW}" in failure.step_failure_data.error.to_string()
    # A model key the registry does not know: its run fails with one line, and the next tick drops the key.
    instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, [STRAY])
    stray = execute(defs, instance, job="embed_documents", partition_key=str(embedding_key(buckets[0], STRAY)))
    assert not stray.success
    description = stray.failure_data_for_node("embeddings").user_failure_data.description
    assert description.startswith(f"unknown model {STRAY!r}") and "\n" not in description
    assert models.coverage(conn, NEW).ready == 0

    # Backfill half of the new model's column (one run over its buckets): only its content is sent, the
    # old column is untouched; search stays on the old model.
    billed = fake.stats["billed_inputs"]
    half_run = execute(defs, instance, job="embed_documents", tags=embed_range_tags(FIRST, [NEW]))
    assert half_run.success
    first_docs = [d for d in KEYS if bucket_of(d) in FIRST]
    assert fake.stats["billed_inputs"] - billed == _chunk_count(conn, first_docs)
    half = models.coverage(conn, NEW)
    assert 0 < half.ready < half.wanted
    with_new = conn.execute(
        """SELECT DISTINCT d.document_id FROM app.documents d
                               JOIN app.chunks c ON c.doc_pk = d.doc_pk
                               JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %s
                               ORDER BY 1""",
        (NEW,),
    ).fetchall()
    assert [r[0] for r in with_new] == sorted(first_docs)
    # The UI's picture: the new column is filled (fresh) in the backfilled buckets, each partition with
    # its coverage, missing elsewhere; the old column is fresh throughout.
    assert set(stale_status(defs, instance, "embeddings", FIRST, NEW).values()) == {"FRESH"}
    assert set(stale_status(defs, instance, "embeddings", SECOND, NEW).values()) == {"MISSING"}
    assert set(stale_status(defs, instance, "embeddings", ALL, OLD).values()) == {"FRESH"}
    filled = latest_materializations(instance, "embeddings", FIRST, NEW)
    for doc in first_docs:
        meta = {k: v.value for k, v in filled[bucket_of(doc)].asset_materialization.metadata.items()}
        assert meta["ready"] == meta["chunks"] == _chunk_count(conn, [doc]) > 0
    waiting = tick(defs, instance, added.cursor)
    assert _model_keys(instance) == [OLD, NEW]  # the stray key is gone
    assert waiting.skip_message.startswith(f"serving {OLD} until {NEW} covers the corpus: {half.ready}/{wanted}")
    assert served_search() == OLD
    assert models.served_model_id(conn) == OLD

    # A bucket run (a source change) is followed by ONE embeddings run over its buckets x every active
    # model: the new model's column fills in, the old one has nothing to send.
    sync = execute(defs, instance, job="sync_documents", tags=range_tags(SECOND))
    assert sync.success
    after = evaluate_sensor(embed_after_sync, defs, instance)
    (request,) = after.run_requests
    assert request.job_name == "embed_documents" and request.tags[AFTER_RUN_TAG] == sync.run_id
    assert {k: v for k, v in request.tags.items() if k != "dagster/sensor_name"} == {
        **embed_range_tags(SECOND, [OLD, NEW]),
        AFTER_RUN_TAG: sync.run_id,
    }
    billed = fake.stats["billed_inputs"]
    rest = execute(defs, instance, request)
    assert rest.success
    second_docs = [d for d in KEYS if bucket_of(d) in SECOND]
    assert fake.stats["billed_inputs"] - billed == _chunk_count(conn, second_docs)  # the new model's only
    assert {k: v.value for k, v in rest.asset_materializations_for_node("embeddings")[0].metadata.items()}[
        "partitions"
    ] == 2 * len(SECOND)
    assert not evaluate_sensor(embed_after_sync, defs, instance, after.cursor).run_requests  # once per sync run
    assert served_search() == OLD  # nothing switches between ticks
    assert waiting.cursor == NEW  # the switch is still pending

    # The next tick serves the new model, retires the old one: its column leaves the partitions.
    switched = tick(defs, instance, waiting.cursor)
    assert switched.cursor == f"served:{NEW}"
    assert models.served_model_id(conn) == NEW and served_search() == NEW
    assert "model_served" in switched.skip_message
    assert _model_keys(instance) == [NEW]
    [(active, retired_at)] = conn.execute(
        "SELECT active, retired_at FROM app.models WHERE model_id = %s", (OLD,)
    ).fetchall()
    assert not active and retired_at is not None
    # The old model's work is over (nothing waits for a worker that never comes); its vectors stay for the grace.
    assert (
        conn.execute(
            "SELECT count(*) FROM app.embedding_jobs WHERE model_id = %s AND status IN "
            "('pending', 'retry', 'processing')",
            (OLD,),
        ).fetchone()[0]
        == 0
    )
    assert conn.execute("SELECT count(*) FROM app.embeddings WHERE model_id = %s", (OLD,)).fetchone()[0] == wanted
    assert set(stale_status(defs, instance, "embeddings", [*FIRST, *SECOND]).values()) == {"FRESH"}
    # The buckets between the two runs were never run for the new model (they hold no document here; a
    # backfill of the missing partitions fills them, sending nothing).
    assert set(stale_status(defs, instance, "embeddings", ALL[len(FIRST) : -len(SECOND)]).values()) == {"MISSING"}
    assert tick(defs, instance, switched.cursor).skip_message == f"serving the configured model {NEW}"

    # A rollback by hand is not overruled: the configured model was served once already.
    settings = Settings.from_env()
    with db.make_pool(db.database_url(settings.database_config()), max_size=2) as pool:
        model_admin.activate(pool, FAKE_MODEL, max_attempts=settings.max_attempts)
        assert model_admin.serve(pool, FAKE_MODEL)["previous"] == NEW
    left = tick(defs, instance, switched.cursor)
    assert left.skip_message.startswith(f"serving {OLD}, served by hand after the configured {NEW} was")
    assert models.served_model_id(conn) == OLD and served_search() == OLD
    assert _model_keys(instance) == [NEW, OLD]  # active again: its column is back
    # `pipeline-assets models add` (the registry, no Dagster): the next tick of either sensor adds its column.
    with db.make_pool(db.database_url(settings.database_config()), max_size=2) as pool:
        model_admin.add(settings, pool, STRAY.split("/", 1)[1])
    assert not evaluate_sensor(embed_after_sync, defs, instance, after.cursor).run_requests
    assert _model_keys(instance) == [NEW, OLD, STRAY]

    events = observed_events(instance)  # three: the hand-made rollback is not the sensor's event
    assert [(e["event"], e["model"], e["served_model"]) for e in events] == [
        ("model_configured", OLD, OLD),
        ("model_configured", NEW, OLD),
        ("model_served", NEW, NEW),
    ]
    assert events[1]["newly_registered"] is True and events[1]["enqueued"] == wanted
    assert events[1]["previous_configured"] == OLD
    assert events[2]["previous_model"] == OLD and events[2]["retired_model"] == OLD
    assert events[2]["coverage_ready"] == events[2]["coverage_wanted"] == wanted


def test_an_instance_of_bucket_only_embeddings_upgrades_without_re_embedding(corpus, conn, fake, server_url):
    """The upgrade: an instance whose embeddings materializations carry bucket keys (the scheme before
    bucket x model), no model key. The sensors' first ticks add the key and embed after the latest
    bucket run only; that run sends nothing (every vector is there) and fills the model's column."""
    defs = fresh_defs()
    with postgres_instance(server_url) as instance:
        assert execute(defs, instance, tags=range_tags(ALL)).success  # the store is embedded
        # What the old scheme left: embeddings by bucket, no model partitions.
        instance.wipe_assets([EMBEDDINGS])
        for key in ALL:
            instance.report_runless_asset_event(dg.AssetMaterialization(EMBEDDINGS, partition=key))
        for model in _model_keys(instance):
            instance.delete_dynamic_partition(MODEL_PARTITIONS_NAME, model)
        billed, requests = fake.stats["billed_inputs"], fake.stats["requests"]
        ticked = tick(defs, instance, None)
        assert _model_keys(instance) == [OLD]
        # The cells exist and say what is true: not recorded yet (never a false FRESH).
        assert set(stale_status(defs, instance, "embeddings", ALL).values()) == {"MISSING"}
        (request,) = evaluate_sensor(embed_after_sync, defs, instance).run_requests
        assert request.tags["dagster/asset_partition_range_start"] == str(embedding_key(ALL[0], OLD))
        run = execute(defs, instance, request)
        assert run.success and fake.stats["billed_inputs"] == billed and fake.stats["requests"] == requests
        meta = {k: v.value for k, v in run.asset_materializations_for_node("embeddings")[0].metadata.items()}
        assert meta["embedded"] == meta["provider_calls"] == 0
        assert set(stale_status(defs, instance, "embeddings", ALL).values()) == {"FRESH"}
        assert models.served_model_id(conn) == OLD and "model_configured" in ticked.skip_message


def test_which_runs_are_followed_by_an_embeddings_run():
    """A bucket run of ours or the UI's materialization of documents and chunks, never a backfill's run
    (the backfill runs its own embeddings) nor a run that embedded already."""
    sync = dg.DagsterRun(job_name="sync_documents", run_id="r1", tags={"dagster/partition": "b003"})
    ui = dg.DagsterRun(
        job_name="__ASSET_JOB",
        run_id="r2",
        asset_selection=frozenset({DOCUMENTS, CHUNKS}),
        tags={RANGE_START: "b001", RANGE_END: "b009"},
    )
    backfill = dg.DagsterRun(
        job_name="__ASSET_JOB",
        run_id="r3",
        asset_selection=frozenset({DOCUMENTS, CHUNKS}),
        tags={"dagster/backfill": "x"},
    )
    embedded = dg.DagsterRun(job_name="__ASSET_JOB", run_id="r4", asset_selection=frozenset({CHUNKS, EMBEDDINGS}))
    assert [chains(r) for r in (sync, ui, backfill, embedded)] == [True, True, False, False]
    one = embed_request(sync, [OLD])
    assert one.partition_key == f"b003|{OLD}" and one.run_key == "embed-after:r1"
    both = embed_request(ui, [OLD, NEW])
    assert (both.tags[RANGE_START], both.tags[RANGE_END]) == (f"b001|{OLD}", f"b009|{NEW}")
    assert embed_request(sync, []) is None  # no active model: nothing to embed
