"""Reconciliation as an asset, and the sensors that trigger it besides the schedule.

``reconciliation`` runs the core's ``reconcile_all`` (re-scan every ingested
source, repair the job table set-based) and then tells Dagster what it changed
in the watched source, so the UI does not drift from the database: each bucket
holding a document it ingested, re-ingested or tombstoned gets a ``documents``
and a ``chunks`` materialization (public runtime ``AssetMaterialization``
events, with the bucket's counts and the ids it changed, and its data and code
versions as an asset run records them: ``provenance``). ``embeddings`` gets
nothing: its jobs are only enqueued, so the next embeddings run (or a ``work``
process) embeds them. A re-ingested file of the watched source is one the
source sensor requests a bucket run for (its bytes differ from the last synced
ones), at once also when it was waiting out the backoff of a failed request
(``observations.retry_now``): that run finds the bytes stored and embeds the
new chunks.

Those events belong to the reconciliation run (lineage: "materialized by
reconcile_job"). Its own counts (new, changed, deleted, enqueued, superseded,
rescued, ... and the buckets reported) are numeric metadata of the
``reconciliation`` materialization, plotted run over run.

Sensors, besides the ``reconcile_hourly`` schedule:

* ``reconcile_on_dead_letters``: the dead-letter queue grew past
  ``PIPELINE_DLQ_GROWTH_PER_HOUR`` within the last hour (the threshold of the
  ``dead_letter_growth`` check) and has grown since the sensor last asked;
* ``reconcile_on_run_failure``: a run of this code location failed (other than
  a reconciliation itself): a repair of the job table only (``rescan: false``:
  no source file is read; the source sensor requests the failed run's files
  again), at most one per RUN_FAILURE_RECONCILE_INTERVAL_SECONDS.
Neither requests a run while a reconciliation is queued or running.
"""

import json
import time
from collections.abc import Iterator

import dagster as dg

from pipeline_assets.app import buckets as bk
from pipeline_assets.app import observations, reports, stages
from pipeline_assets.app.reconcile import reconcile_all
from pipeline_assets.app.runtime import code_versions
from pipeline_assets.app.touched import touched_since
from pipeline_assets.defs.assets import GROUP, ingest_materializations
from pipeline_assets.defs.checks import HOUR_SECONDS
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.defs.run_requests import IN_FLIGHT
from pipeline_assets.settings import Settings

RECONCILIATION = dg.AssetKey("reconciliation")
RECONCILE_JOB_NAME = "reconcile_job"

# The dead-letter sensor reads two counts; once a minute is plenty for an
# hourly growth rate, and bounds how often it can request a reconciliation.
DLQ_SENSOR_INTERVAL_SECONDS = 60
# At most one reconciliation per this many seconds for failed runs, however many fail:
# a run that fails again and again costs one job-table repair per interval.
RUN_FAILURE_RECONCILE_INTERVAL_SECONDS = 600
RUN_FAILURE_TRIGGER = "run_failure"


class ReconcileConfig(dg.Config):
    rescan: bool = True   # false: repair the job table only; no source file is read


def build_reconciliation(settings: Settings) -> dg.AssetsDefinition:
    """The reconciliation asset."""

    @dg.asset(name="reconciliation", group_name=GROUP, kinds={"postgres"},
              description="Re-scan every ingested source and repair the job table (core reconcile(); "
                          "config rescan: false repairs the job table only). Buckets of the watched source in "
                          "which it added, changed or tombstoned documents get documents/chunks "
                          "materializations. Its counts are numeric metadata.")
    def reconciliation(context: dg.AssetExecutionContext, config: ReconcileConfig, postgres: PostgresResource,
                       embedding_provider: EmbeddingProviderResource,
                       source: SourceDirectoryResource) -> Iterator[dg.MaterializeResult | dg.AssetMaterialization]:
        started = time.monotonic()
        rt = embedding_provider.runtime(run_id=context.run.run_id)
        root = source.source(rt.settings).key
        n = postgres.bucket_count(rt.settings.partition_buckets)
        with postgres.connection() as conn:
            since = stages.clock(conn)
        report = reconcile_all(rt, postgres.pool(), rescan=config.rescan)
        with postgres.connection() as conn:
            touched = bk.buckets_of([t.document_id for t in touched_since(conn, root, since)], n)
            observations.retry_now(conn, root, [d for docs in touched.values() for d in docs])
            states = bk.states_of(conn, root, list(touched), n)
        for problem in report.missing_sources:
            context.log.warning(problem)
        yield from ingest_materializations(context.instance, states, {b: {
            "reported_by": "reconciliation", "changed_documents": ", ".join(docs[:bk.SAMPLE_IDS]),
            "changed_count": len(docs)} for b, docs in touched.items()}, code_versions(rt.settings))
        counts = {k: int(v) for k, v in report.as_dict().items() if isinstance(v, int)}
        metadata: dict = {**counts, "missing_sources": len(report.missing_sources),
                          "buckets_reported": len(touched),
                          "documents_reported": sum(len(d) for d in touched.values()), "source_root": root,
                          "duration_seconds": round(time.monotonic() - started, 3)}
        if report.missing_sources:
            metadata["missing_source_errors"] = "\n".join(report.missing_sources)
        yield dg.MaterializeResult(metadata=metadata)

    return reconciliation


RECONCILE_JOB = dg.define_asset_job(
    RECONCILE_JOB_NAME, selection=[RECONCILIATION],
    description="Reconcile sources and the job table; report the buckets it changed as materializations.")


def _reconciliation_active(instance: dg.DagsterInstance) -> bool:
    return bool(instance.get_run_records(dg.RunsFilter(job_name=RECONCILE_JOB_NAME, statuses=IN_FLIGHT),
                                         limit=1))


@dg.sensor(name="reconcile_on_dead_letters", job=RECONCILE_JOB, minimum_interval_seconds=DLQ_SENSOR_INTERVAL_SECONDS,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Requests a reconciliation when the dead-letter queue grew by more than "
                       "PIPELINE_DLQ_GROWTH_PER_HOUR in the last hour (the dead_letter_growth check's "
                       "threshold) and has grown since the last request.")
def reconcile_on_dead_letters(context: dg.SensorEvaluationContext, postgres: PostgresResource,
                              embedding_provider: EmbeddingProviderResource):
    threshold = embedding_provider.settings().dlq_growth_per_hour
    with postgres.connection() as conn:
        recent, total = reports.dead_letter_growth(conn, HOUR_SECONDS)
    asked_at = json.loads(context.cursor)["failed_total"] if context.cursor else None
    if recent <= threshold:
        return dg.SkipReason(f"{recent} job(s) failed in the last hour (threshold {threshold}/h)")
    if asked_at is not None and total <= asked_at:
        return dg.SkipReason(f"{recent} failed in the last hour, but no new failure since the last request "
                             f"({total} failed in all)")
    if _reconciliation_active(context.instance):
        return dg.SkipReason("a reconciliation is already queued or running")
    context.update_cursor(json.dumps({"failed_total": total}))
    return dg.RunRequest(tags={"pipeline/trigger": "dead_letters", "pipeline/failed_last_hour": str(recent)})


def _repaired_since(instance: dg.DagsterInstance, seconds: float) -> float | None:
    """Seconds since the latest reconciliation this sensor requested, if within ``seconds``."""
    records = instance.get_run_records(dg.RunsFilter(job_name=RECONCILE_JOB_NAME,
                                                     tags={"pipeline/trigger": RUN_FAILURE_TRIGGER}), limit=1)
    if not records:
        return None
    age = time.time() - records[0].create_timestamp.timestamp()
    return age if age < seconds else None


@dg.run_failure_sensor(name="reconcile_on_run_failure", request_job=RECONCILE_JOB,
                       default_status=dg.DefaultSensorStatus.RUNNING,
                       description="Requests a repair of the job table (lost leases rescued, missing jobs "
                                   "enqueued; no source file read) when a run of this code location fails, at most "
                                   "one per 10 minutes; not for a failed reconciliation. The failed run's source "
                                   "changes are requested again by the source sensor.")
def reconcile_on_run_failure(context: dg.RunFailureSensorContext):
    run = context.dagster_run
    if run.job_name == RECONCILE_JOB_NAME:
        return dg.SkipReason("a reconciliation failed: not retried by this sensor")
    if _reconciliation_active(context.instance):
        return dg.SkipReason("a reconciliation is already queued or running")
    age = _repaired_since(context.instance, RUN_FAILURE_RECONCILE_INTERVAL_SECONDS)
    if age is not None:
        return dg.SkipReason(f"a repair after a failed run was requested {age:.0f} s ago (at most one per "
                             f"{RUN_FAILURE_RECONCILE_INTERVAL_SECONDS} s)")
    return dg.RunRequest(run_key=f"after-failed-run:{run.run_id}",
                         run_config={"ops": {"reconciliation": {"config": {"rescan": False}}}},
                         tags={"pipeline/trigger": RUN_FAILURE_TRIGGER, "pipeline/failed_run": run.run_id})


RECONCILE_SENSORS = [reconcile_on_dead_letters, reconcile_on_run_failure]
