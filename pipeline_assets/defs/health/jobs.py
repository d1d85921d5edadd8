"""``pipeline_health``: the store's health checks alone."""

import dagster as dg

from pipeline_assets.defs.health.checks import HEALTH_CHECKS

HEALTH_JOB = dg.define_asset_job(
    "pipeline_health",
    selection=HEALTH_CHECKS,
    description="The store's health checks alone (stale vectors, dead-letter growth): whole-store queries, "
    "run on the pipeline_health_checks schedule instead of after every partition run.",
)
