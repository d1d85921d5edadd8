"""Reconciliation as an asset, and the sensors that trigger it besides the schedule.

``reconciliation`` runs the core's ``reconcile_all`` (re-scan every ingested
source, repair the job table set-based) and then tells Dagster what it changed
in the watched source, so the UI does not drift from the database:

* a document it ingested for the first time gets its partition (a dynamic
  partition added), and a ``documents`` and ``chunks`` materialization;
* a document it re-ingested (changed bytes, quarantined) gets a ``documents``
  and ``chunks`` materialization with its new data version: reconciliation
  really did extract, chunk and enqueue it. ``embeddings`` gets nothing: its
  jobs are only enqueued, so Dagster shows it stale where the chunks changed;
* a document it tombstoned (its file is gone) loses its partition, as the
  source sensor does for a vanished file.

Those events belong to the reconciliation run (lineage: "materialized by
reconcile_job"), written in one batch. Its own counts (new, changed, deleted,
enqueued, superseded, rescued, ... and the partitions added/deleted/reported)
are numeric metadata of the ``reconciliation`` materialization, plotted run over run.

Sensors, besides the ``reconcile_hourly`` schedule:

* ``reconcile_on_dead_letters``: the dead-letter queue grew past
  ``PIPELINE_DLQ_GROWTH_PER_HOUR`` within the last hour (the threshold of the
  ``dead_letter_growth`` check) and has grown since the sensor last asked;
* ``reconcile_on_run_failure``: a run of this code location failed (other than
  a reconciliation itself).
Neither requests a run while a reconciliation is queued or running.
"""

import json
import time
from typing import Iterator, Mapping

import dagster as dg
from dagster._core.definitions.data_version import (CODE_VERSION_TAG, DATA_VERSION_IS_USER_PROVIDED_TAG,
                                                    DATA_VERSION_TAG, NULL_EVENT_POINTER,
                                                    get_input_data_version_tag, get_input_event_pointer_tag)
from dagster._core.events import DagsterEvent, DagsterEventBatchMetadata, generate_event_batch_id

from pipeline_assets.app import reports, stages
from pipeline_assets.app.reconcile import reconcile_all
from pipeline_assets.app.runtime import code_versions
from pipeline_assets.app.touched import touched_since
from pipeline_assets.defs.assets import (CHUNKS, DOCUMENTS, GROUP, PARTITIONS_NAME, ingest_versions,
                                         partition_key_problem)
from pipeline_assets.defs import extractor_observations as observe
from pipeline_assets.defs.checks import HOUR_SECONDS
from pipeline_assets.defs.partition_versions import PartitionVersion, latest_storage_id
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource, SourceDirectoryResource
from pipeline_assets.settings import Settings

RECONCILIATION = dg.AssetKey("reconciliation")
RECONCILE_JOB_NAME = "reconcile_job"

# The dead-letter sensor reads two counts; once a minute is plenty for an
# hourly growth rate, and bounds how often it can request a reconciliation.
DLQ_SENSOR_INTERVAL_SECONDS = 60

ACTIVE_RUN_STATUSES = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
                       dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]


def build_reconciliation(settings: Settings) -> dg.AssetsDefinition:
    """The reconciliation asset; the settings give the code versions its documents/chunks events carry."""
    versions = code_versions(settings)

    @dg.asset(name="reconciliation", group_name=GROUP, kinds={"postgres"},
              description="Re-scan every ingested source and repair the job table (core reconcile()). "
                          "Documents it adds, changes or tombstones in the watched source show up as "
                          "partitions added, documents/chunks materializations, partitions deleted. "
                          "Its counts are numeric metadata.")
    def reconciliation(context: dg.AssetExecutionContext, postgres: PostgresResource,
                       embedding_provider: EmbeddingProviderResource,
                       source: SourceDirectoryResource) -> Iterator[dg.MaterializeResult | DagsterEvent]:
        started = time.monotonic()
        rt = embedding_provider.runtime(run_id=context.run.run_id)
        root = str(source.root_path(rt.settings))
        with postgres.connection() as conn:
            since = stages.clock(conn)
        report = reconcile_all(rt, postgres.pool(), rescan=True)
        with postgres.connection() as conn:
            touched = [t for t in touched_since(conn, root, since) if not partition_key_problem(t.document_id)]
            kept = [t.document_id for t in touched if t.status != "deleted"]
            summaries = reports.document_summaries(conn, root, kept)
        instance = context.instance
        known = set(instance.get_dynamic_partitions(PARTITIONS_NAME))
        added = [key for key in kept if key not in known]
        deleted = [t.document_id for t in touched if t.status == "deleted" and t.document_id in known]
        if added:
            instance.add_dynamic_partitions(PARTITIONS_NAME, added)
        for key in deleted:
            instance.delete_dynamic_partition(PARTITIONS_NAME, key)
        for problem in report.missing_sources:
            context.log.warning(problem)
        counts = {k: int(v) for k, v in report.as_dict().items() if isinstance(v, int)}
        metadata: dict = {**counts, "missing_sources": len(report.missing_sources),
                          "partitions_added": len(added), "partitions_deleted": len(deleted),
                          "partitions_reported": len(kept), "source_root": root}
        if report.missing_sources:
            metadata["missing_source_errors"] = "\n".join(report.missing_sources)
        if kept:
            docs, chunks = ingest_versions(summaries, kept, rt.options.extractor_version)
            new = observe.changed(instance, {k: rt.options.extractor_version.of(k) for k in kept})
            if new:
                yield from observe.observation_events(context, new)
            yield from _partition_events(context, DOCUMENTS, versions["documents"], docs)
            yield from _partition_events(context, CHUNKS, versions["chunks"], chunks)
        metadata["duration_seconds"] = round(time.monotonic() - started, 3)
        yield dg.MaterializeResult(metadata=metadata)

    return reconciliation


def _partition_events(context: dg.AssetExecutionContext, asset_key: dg.AssetKey, code_version: str,
                      versions: Mapping[str, PartitionVersion]) -> Iterator[DagsterEvent]:
    """One materialization per partition of an asset this step does not own, with the data version,
    code version and provenance tags Dagster's staleness reads; written as one batch (as
    ``partition_versions`` writes a range run's own events)."""
    pointers = {dep: latest_storage_id(context.instance, dep) for v in versions.values() for dep in v.inputs}
    step = context.get_step_execution_context()
    batch_id = generate_event_batch_id()
    last = len(versions) - 1
    for i, (partition, version) in enumerate(versions.items()):
        tags = {CODE_VERSION_TAG: code_version, DATA_VERSION_TAG: version.data_version,
                DATA_VERSION_IS_USER_PROVIDED_TAG: "true"}
        for dep, input_version in version.inputs.items():
            tags[get_input_data_version_tag(dep)] = input_version
            pointer = pointers.get(dep)
            tags[get_input_event_pointer_tag(dep)] = str(pointer) if pointer else NULL_EVENT_POINTER
        event = dg.AssetMaterialization(asset_key=asset_key, partition=partition, tags=tags,
                                        metadata={**version.metadata, "reported_by": "reconciliation"})
        yield DagsterEvent.asset_materialization(step, event, DagsterEventBatchMetadata(batch_id, i == last))


RECONCILE_JOB = dg.define_asset_job(
    RECONCILE_JOB_NAME, selection=[RECONCILIATION],
    description="Reconcile sources and the job table; report what changed as partitions and materializations.")


def _reconciliation_active(instance: dg.DagsterInstance) -> bool:
    return bool(instance.get_run_records(dg.RunsFilter(job_name=RECONCILE_JOB_NAME, statuses=ACTIVE_RUN_STATUSES),
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


@dg.run_failure_sensor(name="reconcile_on_run_failure", request_job=RECONCILE_JOB,
                       default_status=dg.DefaultSensorStatus.RUNNING,
                       description="Requests a reconciliation when a run of this code location fails "
                                   "(lost leases rescued, missing jobs enqueued), not for a failed reconciliation.")
def reconcile_on_run_failure(context: dg.RunFailureSensorContext):
    run = context.dagster_run
    if run.job_name == RECONCILE_JOB_NAME:
        return dg.SkipReason("a reconciliation failed: not retried by this sensor")
    if _reconciliation_active(context.instance):
        return dg.SkipReason("a reconciliation is already queued or running")
    return dg.RunRequest(run_key=f"after-failed-run:{run.run_id}",
                         tags={"pipeline/trigger": "run_failure", "pipeline/failed_run": run.run_id})


RECONCILE_SENSORS = [reconcile_on_dead_letters, reconcile_on_run_failure]
