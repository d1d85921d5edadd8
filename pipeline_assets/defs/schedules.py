"""Schedules: reconciliation (hourly by default) and the store's health checks.

Reconciliation is how missed events are repaired: the ``reconciliation`` asset
(``reconcile.py``) runs the core's ``reconcile()`` and reports the buckets it changed as
materializations, its counts as numeric metadata. Sensors request
it too (dead-letter growth, a failed run); this schedule is the steady beat.
"""

import dagster as dg

from pipeline_assets.defs.checks import HEALTH_CHECKS
from pipeline_assets.defs.reconcile import RECONCILE_JOB
from pipeline_assets.settings import Settings

HEALTH_JOB = dg.define_asset_job(
    "pipeline_health", selection=HEALTH_CHECKS,
    description="The store's health checks alone (stale vectors, dead-letter growth): whole-store queries, "
                "run on the pipeline_health_checks schedule instead of after every partition run.")


def build_schedules(settings: Settings) -> list[dg.ScheduleDefinition]:
    return [
        dg.ScheduleDefinition(
            name="reconcile_hourly", job=RECONCILE_JOB,
            cron_schedule=settings.reconcile_cron,
            default_status=dg.DefaultScheduleStatus.RUNNING,
            description="Reconciliation; cron from PIPELINE_RECONCILE_CRON (default hourly)."),
        dg.ScheduleDefinition(
            name="pipeline_health_checks", job=HEALTH_JOB,
            cron_schedule=settings.health_cron,
            default_status=dg.DefaultScheduleStatus.RUNNING,
            description="Health checks of embedding_store (stale vectors, dead-letter growth); cron from "
                        "PIPELINE_HEALTH_CRON (default every 15 min)."),
    ]
