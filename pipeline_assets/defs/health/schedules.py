"""``pipeline_health_checks``: the store's health checks on PIPELINE_HEALTH_CRON."""

import dagster as dg

from pipeline_assets.defs.health.jobs import HEALTH_JOB


def build_health_schedule(cron: str) -> dg.ScheduleDefinition:
    """The schedule at ``cron`` (``Settings.health_cron``, every 15 min by default)."""
    return dg.ScheduleDefinition(
        name="pipeline_health_checks",
        job=HEALTH_JOB,
        cron_schedule=cron,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Health checks of embedding_store (stale vectors, dead-letter growth); cron from "
        "PIPELINE_HEALTH_CRON (default every 15 min).",
    )
