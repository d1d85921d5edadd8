"""``reconcile_job``: the reconciliation asset alone."""

import dagster as dg

from pipeline_assets.defs.keys import RECONCILIATION

RECONCILE_JOB_NAME = "reconcile_job"
RECONCILE_JOB = dg.define_asset_job(
    RECONCILE_JOB_NAME,
    selection=[RECONCILIATION],
    description="Reconcile sources and the job table; report the buckets it changed as materializations.",
)
