"""The sensors that request a reconciliation besides the ``reconcile_hourly`` schedule.

* ``reconcile_on_dead_letters``: the dead-letter queue grew past PIPELINE_DLQ_GROWTH_PER_HOUR
  within the last hour (the ``dead_letter_growth`` check's threshold) and has grown since the
  sensor last asked;
* ``reconcile_on_run_failure``: a run of this code location failed (not a reconciliation): a
  repair of the job table only (``rescan: false``), at most one per
  RUN_FAILURE_RECONCILE_INTERVAL_SECONDS; the source sensor requests the failed run's files again.

Neither requests a run while a reconciliation is queued or running.
"""

import json
import time

import dagster as dg

from pipeline_assets.defs.health.checks import HOUR_SECONDS
from pipeline_assets.defs.reconcile.jobs import RECONCILE_JOB, RECONCILE_JOB_NAME
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource
from pipeline_assets.defs.run_requests import IN_FLIGHT
from pipeline_assets.store import reports

# The dead-letter sensor reads two counts; once a minute is plenty for an
# hourly growth rate, and bounds how often it can request a reconciliation.
DLQ_SENSOR_INTERVAL_SECONDS = 60
# At most one reconciliation per this many seconds for failed runs, however many fail:
# a run that fails again and again costs one job-table repair per interval.
RUN_FAILURE_RECONCILE_INTERVAL_SECONDS = 600
RUN_FAILURE_TRIGGER = "run_failure"


def _reconciliation_active(instance: dg.DagsterInstance) -> bool:
    return bool(instance.get_run_records(dg.RunsFilter(job_name=RECONCILE_JOB_NAME, statuses=IN_FLIGHT), limit=1))


@dg.sensor(
    name="reconcile_on_dead_letters",
    job=RECONCILE_JOB,
    minimum_interval_seconds=DLQ_SENSOR_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Requests a reconciliation when the dead-letter queue grew by more than "
    "PIPELINE_DLQ_GROWTH_PER_HOUR in the last hour (the dead_letter_growth check's "
    "threshold) and has grown since the last request.",
)
def reconcile_on_dead_letters(
    context: dg.SensorEvaluationContext, postgres: PostgresResource, embedding_provider: EmbeddingProviderResource
) -> dg.RunRequest | dg.SkipReason:
    threshold = embedding_provider.settings().dagster_config().dlq_growth_per_hour
    with postgres.connection() as conn:
        recent, total = reports.dead_letter_growth(conn, HOUR_SECONDS)
    asked_at = json.loads(context.cursor)["failed_total"] if context.cursor else None
    if recent <= threshold:
        return dg.SkipReason(f"{recent} job(s) failed in the last hour (threshold {threshold}/h)")
    if asked_at is not None and total <= asked_at:
        return dg.SkipReason(
            f"{recent} failed in the last hour, but no new failure since the last request ({total} failed in all)"
        )
    if _reconciliation_active(context.instance):
        return dg.SkipReason("a reconciliation is already queued or running")
    context.update_cursor(json.dumps({"failed_total": total}))
    return dg.RunRequest(tags={"pipeline/trigger": "dead_letters", "pipeline/failed_last_hour": str(recent)})


def _repaired_since(instance: dg.DagsterInstance, seconds: float) -> float | None:
    """Seconds since the latest reconciliation this sensor requested, if within ``seconds``."""
    records = instance.get_run_records(
        dg.RunsFilter(job_name=RECONCILE_JOB_NAME, tags={"pipeline/trigger": RUN_FAILURE_TRIGGER}), limit=1
    )
    if not records:
        return None
    age = time.time() - records[0].create_timestamp.timestamp()
    return age if age < seconds else None


@dg.run_failure_sensor(
    name="reconcile_on_run_failure",
    request_job=RECONCILE_JOB,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Requests a repair of the job table (lost leases rescued, missing jobs "
    "enqueued; no source file read) when a run of this code location fails, at most "
    "one per 10 minutes; not for a failed reconciliation. The failed run's source "
    "changes are requested again by the source sensor.",
)
def reconcile_on_run_failure(context: dg.RunFailureSensorContext) -> dg.RunRequest | dg.SkipReason:
    run = context.dagster_run
    if run.job_name == RECONCILE_JOB_NAME:
        return dg.SkipReason("a reconciliation failed: not retried by this sensor")
    if _reconciliation_active(context.instance):
        return dg.SkipReason("a reconciliation is already queued or running")
    age = _repaired_since(context.instance, RUN_FAILURE_RECONCILE_INTERVAL_SECONDS)
    if age is not None:
        return dg.SkipReason(
            f"a repair after a failed run was requested {age:.0f} s ago (at most one per "
            f"{RUN_FAILURE_RECONCILE_INTERVAL_SECONDS} s)"
        )
    return dg.RunRequest(
        run_key=f"after-failed-run:{run.run_id}",
        run_config={"ops": {"reconciliation": {"config": {"rescan": False}}}},
        tags={"pipeline/trigger": RUN_FAILURE_TRIGGER, "pipeline/failed_run": run.run_id},
    )


SENSORS = [reconcile_on_dead_letters, reconcile_on_run_failure]
