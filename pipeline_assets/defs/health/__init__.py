"""Health: ``embedding_store``, its checks, ``pipeline_health`` and its schedule."""

import dagster as dg

from pipeline_assets.defs.health.assets import EMBEDDING_STORE_SPEC
from pipeline_assets.defs.health.checks import STORE_CHECKS
from pipeline_assets.defs.health.jobs import HEALTH_JOB
from pipeline_assets.defs.health.schedules import build_health_schedule
from pipeline_assets.settings import Settings


def definitions(settings: Settings) -> dg.Definitions:
    """The domain under ``settings``: the schedule's cron."""
    return dg.Definitions(
        assets=[EMBEDDING_STORE_SPEC],
        asset_checks=STORE_CHECKS,
        jobs=[HEALTH_JOB],
        schedules=[build_health_schedule(settings.dagster_config().health_cron)],
    )
