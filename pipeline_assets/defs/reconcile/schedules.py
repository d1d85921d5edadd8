"""``reconcile_hourly``: reconciliation's steady beat (its sensors request it on events too)."""

import dagster as dg

from pipeline_assets.defs.reconcile.jobs import RECONCILE_JOB


def build_reconcile_schedule(cron: str) -> dg.ScheduleDefinition:
    """The schedule at ``cron`` (``Settings.reconcile_cron``, hourly by default)."""
    return dg.ScheduleDefinition(
        name="reconcile_hourly",
        job=RECONCILE_JOB,
        cron_schedule=cron,
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Reconciliation; cron from PIPELINE_RECONCILE_CRON (default hourly).",
    )
