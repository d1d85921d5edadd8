"""``model_switch``: a model change as a Dagster-visible event, without downtime.

Each active model of the registry is a column of ``embeddings``. Every tick the sensor does the
registry's part (``app.model_follow.follow_configured``): it registers the configured model (jobs
for every current chunk) and records ``model_configured`` on ``embedding_store`` when it differs
from the one its cursor saw; once the new model covers every current chunk, it serves it, retires
the old one (deleted by reconcile after PIPELINE_MODEL_RETIRE_GRACE) and records ``model_served``.
The configured model wins once: a model served by hand afterwards (``models serve``) is left alone
(cursor ``served:<model>``). It also keeps the model keys the registry's active models
(``models/partitions.py``). An embeddings run embeds with its partition keys' models only.
"""

import dagster as dg

from pipeline_assets.app import model_admin, model_follow
from pipeline_assets.defs.keys import EMBEDDING_STORE
from pipeline_assets.defs.models.partitions import model_keys
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource
from pipeline_assets.registry.models import Coverage

SENSOR_NAME = "model_switch"

# How often the sensor compares the configured model with the served one; bounds
# how long search stays on the old model after the new one covers the corpus.
SWITCH_INTERVAL_SECONDS = 30


def _coverage_metadata(cov: Coverage | None) -> dict[str, int]:
    if cov is None:  # not read: no switch pending
        return {}
    return {
        "coverage_ready": cov.ready,
        "coverage_wanted": cov.wanted,
        "missing": cov.missing,
        "waiting": cov.waiting,
        "failed": cov.failed,
    }


DONE = "served:"  # cursor prefix: the configured model has been served once under this configuration


def parse_cursor(cursor: str | None) -> tuple[str | None, bool]:
    """(the configured model the sensor saw last, whether it has been served since)."""
    if not cursor:
        return None, False
    return (cursor[len(DONE) :], True) if cursor.startswith(DONE) else (cursor, False)


def switch_events(outcome: model_follow.ModelFollowed, last_seen: str | None) -> list[dg.AssetObservation]:
    """The observations one evaluation records: the configured model changed (since the
    model ``last_seen`` by this sensor, its cursor), and a model served (one retired)."""
    events = []
    cov = outcome.coverage
    if outcome.model_id != last_seen:
        events.append(
            dg.AssetObservation(
                EMBEDDING_STORE,
                metadata={
                    "event": "model_configured",
                    "model": outcome.model_id,
                    "previous_configured": last_seen or "",
                    "served_model": outcome.served or "",
                    "newly_registered": outcome.added,
                    "enqueued": outcome.enqueued,
                    **_coverage_metadata(cov),
                },
            )
        )
    if outcome.switched:
        events.append(
            dg.AssetObservation(
                EMBEDDING_STORE,
                metadata={
                    "event": "model_served",
                    "model": outcome.model_id,
                    "served_model": outcome.served,
                    "previous_model": outcome.switched_from or "",
                    "retired_model": outcome.retired or "",
                    **_coverage_metadata(cov),
                },
            )
        )
    return events


@dg.sensor(
    name=SENSOR_NAME,
    minimum_interval_seconds=SWITCH_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Follows PIPELINE_EMBEDDING_MODEL without downtime: registers a new model (jobs for every "
    "current chunk), keeps search on the served model until the new one covers the corpus, "
    "then serves it and retires the old one. Each step is an observation on embedding_store. "
    "Keeps the model partitions of embeddings the registry's active models.",
)
def model_switch_sensor(
    context: dg.SensorEvaluationContext, postgres: PostgresResource, embedding_provider: EmbeddingProviderResource
) -> dg.SensorResult:
    # A retired configured model raises ModelRetired: a failed tick, its one line in the UI.
    rt = embedding_provider.runtime()
    last_seen, done = parse_cursor(context.cursor)
    done = done and last_seen == rt.model_id
    outcome = model_follow.follow_configured(rt, postgres.pool(), switch=not done)
    model_id, served = outcome.model_id, outcome.served
    keys, _ = model_keys(context.instance, model_admin.active_model_ids(postgres.pool()))
    cursor = f"{DONE if done or served == model_id else ''}{model_id}"
    events = switch_events(outcome, last_seen)
    if events:
        for event in events:
            context.log.info(f"{event.metadata['event'].value}: {model_id} (served: {served})")
        said = "; ".join(f"{e.metadata['event'].value} {model_id}" for e in events)
        return dg.SensorResult(
            asset_events=events,
            cursor=cursor,
            dynamic_partitions_requests=keys,
            skip_reason=dg.SkipReason(f"{said} (served: {served})"),
        )
    cov = outcome.coverage
    if served == model_id:
        why = f"serving the configured model {model_id}"
    elif done:
        why = (
            f"serving {served}, served by hand after the configured {model_id} was; "
            "left as it is (`pipeline-assets models serve` changes it)"
        )
    else:
        progress = f"{cov.ready}/{cov.wanted} ({cov.describe_missing()})" if cov is not None else "coverage not read"
        why = f"serving {served} until {model_id} covers the corpus: {progress}"
    return dg.SensorResult(cursor=cursor, dynamic_partitions_requests=keys, skip_reason=dg.SkipReason(why))


SENSORS = [model_switch_sensor]
