"""The Dagster code location: assets, checks, jobs, sensors, schedules, resources.

Loaded by the top-level ``workspace.yaml`` (``dagster dev -w workspace.yaml`` or
``pipeline-assets dev``). Everything here is wiring; the modules it imports are
thin layers over the core, which knows nothing of Dagster.

Executor: in-process for every job. A run here is one step per asset doing
set-based database work (the parallelism lives in the worker's threads and the
job table, not in Dagster steps), and the multiprocess executor starts a fresh
Python process importing Dagster and this code for every step: about 5 s of
start-up per run at best. Measured on this project (one partition, 3 assets +
3 checks, dagster.execute_job): 11.4 s multiprocess against 1.2 s in-process.
"""

import os

import dagster as dg

from pipeline_assets.defs.assets import build_assets
from pipeline_assets.defs.checks import CHECKS
from pipeline_assets.defs.resources import resources_from_env
from pipeline_assets.defs.schedules import HEALTH_JOB, build_schedules, reconcile_job
from pipeline_assets.defs.sensors import EMBED_JOB, SENSORS


# Write the materializations of a partition-range run in batches, not one row
# (and one connection) each; see devserver.RUN_EVENT_SETTINGS. Read by the run
# worker, which imports this module; an explicit setting wins.
os.environ.setdefault("DAGSTER_EVENT_BATCH_SIZE", "1000")


def build_definitions() -> dg.Definitions:
    """Definitions from the current environment (code versions, cron, database)."""
    return dg.Definitions(
        assets=build_assets(),
        asset_checks=CHECKS,
        jobs=[EMBED_JOB, reconcile_job, HEALTH_JOB],
        sensors=SENSORS,
        schedules=build_schedules(),
        resources=resources_from_env(),
        executor=dg.in_process_executor,
    )


defs = build_definitions()
