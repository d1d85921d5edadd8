"""A model change as a Dagster-visible event: the ``model_switch`` sensor.

The model is a partition of ``embeddings`` (bucket x model, ``partitions.py``): each
active model of the registry is a column, and a switch is: add the model, backfill
its column (only content without a vector for it is sent), serve it once it covers
the corpus, retire the old one. This sensor does the registry's part
(``app.model_admin.follow_configured``) and keeps the model keys the registry's
active models (``model_partitions.model_keys``; a model added by
``pipeline-assets models add`` gets its column at the next tick):

1. it registers the configured model (``models add``: jobs for every current
   chunk, unless an ingest or run registered it first) and, when the configured
   model differs from the one its cursor saw last, records an
   ``AssetObservation`` on ``embedding_store`` (``model_configured``);
2. while the new model is incomplete, search keeps reading the served (old)
   model; the embeddings runs (a backfill of the new model's column, the runs
   after each bucket run, which cover every active model, or ``work``
   processes) fill the new one;
3. once it covers every current chunk, it serves it, retires the old one
   (its vectors and index are deleted by reconcile after
   PIPELINE_MODEL_RETIRE_GRACE; its column leaves the partition set, its
   history stays in the event log) and records the switch (``model_served``).

The observations carry the served model, the previous one, the coverage, and
show in the UI on ``embedding_store`` (its events and plots). The configured
model wins once: after the sensor (or anyone) served it, a person who serves
another model by hand (``models serve``, a rollback) is left alone; the cursor
(``served:<model>``) remembers that. Changing the configuration starts over.

A launchpad override of the model (``resources.embedding_provider.config.model``)
would register a model nobody works: ``EmbeddingProviderResource.runtime`` refuses a
model that is not the configured one. An embeddings run embeds with the models of
its partition keys, never with the resource's.
"""

import dagster as dg

from pipeline_assets.app import model_admin
from pipeline_assets.defs.keys import EMBEDDING_STORE
from pipeline_assets.defs.model_partitions import model_keys
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource

SENSOR_NAME = "model_switch"

# How often the sensor compares the configured model with the served one; bounds
# how long search stays on the old model after the new one covers the corpus.
SWITCH_INTERVAL_SECONDS = 30


def _coverage_metadata(cov) -> dict:
    if cov is None:   # not read: no switch pending
        return {}
    return {"coverage_ready": cov.ready, "coverage_wanted": cov.wanted, "missing": cov.missing,
            "waiting": cov.waiting, "failed": cov.failed}


DONE = "served:"   # cursor prefix: the configured model has been served once under this configuration


def parse_cursor(cursor: str | None) -> tuple[str | None, bool]:
    """(the configured model the sensor saw last, whether it has been served since)."""
    if not cursor:
        return None, False
    return (cursor[len(DONE):], True) if cursor.startswith(DONE) else (cursor, False)


def switch_events(outcome: model_admin.ModelFollowed, last_seen: str | None) -> list[dg.AssetObservation]:
    """The observations one evaluation records: the configured model changed (since the
    model ``last_seen`` by this sensor, its cursor), and a model served (one retired)."""
    events = []
    cov = outcome.coverage
    if outcome.model_id != last_seen:
        events.append(dg.AssetObservation(EMBEDDING_STORE, metadata={
            "event": "model_configured", "model": outcome.model_id, "previous_configured": last_seen or "",
            "served_model": outcome.served or "", "newly_registered": outcome.added,
            "enqueued": outcome.enqueued, **_coverage_metadata(cov)}))
    if outcome.switched:
        events.append(dg.AssetObservation(EMBEDDING_STORE, metadata={
            "event": "model_served", "model": outcome.model_id, "served_model": outcome.served,
            "previous_model": outcome.switched_from or "", "retired_model": outcome.retired or "",
            **_coverage_metadata(cov)}))
    return events


@dg.sensor(name=SENSOR_NAME, minimum_interval_seconds=SWITCH_INTERVAL_SECONDS,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Follows PIPELINE_EMBEDDING_MODEL without downtime: registers a new model (jobs for every "
                       "current chunk), keeps search on the served model until the new one covers the corpus, "
                       "then serves it and retires the old one. Each step is an observation on embedding_store. "
                       "Keeps the model partitions of embeddings the registry's active models.")
def model_switch_sensor(context: dg.SensorEvaluationContext, postgres: PostgresResource,
                        embedding_provider: EmbeddingProviderResource) -> dg.SensorResult:
    # A retired configured model raises ModelRetired: a failed tick, its one line in the UI.
    rt = embedding_provider.runtime()
    last_seen, done = parse_cursor(context.cursor)
    done = done and last_seen == rt.model_id
    outcome = model_admin.follow_configured(rt, postgres.pool(), switch=not done)
    model_id, served = outcome.model_id, outcome.served
    keys, _ = model_keys(context.instance, model_admin.active_model_ids(postgres.pool()))
    cursor = f"{DONE if done or served == model_id else ''}{model_id}"
    events = switch_events(outcome, last_seen)
    if events:
        for event in events:
            context.log.info(f"{event.metadata['event'].value}: {model_id} (served: {served})")
        said = "; ".join(f"{e.metadata['event'].value} {model_id}" for e in events)
        return dg.SensorResult(asset_events=events, cursor=cursor, dynamic_partitions_requests=keys,
                               skip_reason=dg.SkipReason(f"{said} (served: {served})"))
    cov = outcome.coverage
    if served == model_id:
        why = f"serving the configured model {model_id}"
    elif done:
        why = (f"serving {served}, served by hand after the configured {model_id} was; "
               "left as it is (`pipeline-assets models serve` changes it)")
    else:
        progress = f"{cov.ready}/{cov.wanted} ({cov.describe_missing()})" if cov is not None else "coverage not read"
        why = f"serving {served} until {model_id} covers the corpus: {progress}"
    return dg.SensorResult(cursor=cursor, dynamic_partitions_requests=keys, skip_reason=dg.SkipReason(why))


SENSORS = [model_switch_sensor]
