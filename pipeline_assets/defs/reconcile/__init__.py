"""Reconciliation: the ``reconciliation`` asset, ``reconcile_job``, its sensors and schedule."""

import dagster as dg

from pipeline_assets.defs.reconcile.assets import reconciliation
from pipeline_assets.defs.reconcile.jobs import RECONCILE_JOB
from pipeline_assets.defs.reconcile.schedules import build_reconcile_schedule
from pipeline_assets.defs.reconcile.sensors import SENSORS
from pipeline_assets.settings import Settings


def definitions(settings: Settings) -> dg.Definitions:
    """The domain under ``settings``: the schedule's cron."""
    return dg.Definitions(
        assets=[reconciliation],
        jobs=[RECONCILE_JOB],
        sensors=SENSORS,
        schedules=[build_reconcile_schedule(settings.dagster_config().reconcile_cron)],
    )
