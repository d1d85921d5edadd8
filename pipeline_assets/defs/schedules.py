"""Schedules: reconciliation (hourly by default) and the store's health checks.

Reconciliation is how missed events are repaired: the core's ``reconcile()``
re-scans every ingested source and repairs the job table set-based. The op only
calls it and reports the counts as output metadata (numeric, so the UI plots
them run over run).
"""

import time

import dagster as dg

from pipeline_assets.app.reconcile import reconcile_all
from pipeline_assets.defs.checks import HEALTH_CHECKS
from pipeline_assets.defs.resources import EmbeddingProviderResource, PostgresResource
from pipeline_assets.settings import Settings


@dg.op(description="Re-scan the ingested sources and repair the job table (core reconcile()).")
def reconcile_op(context: dg.OpExecutionContext, postgres: PostgresResource,
                 embedding_provider: EmbeddingProviderResource) -> dg.Output[dict]:
    started = time.monotonic()
    report = reconcile_all(embedding_provider.runtime(run_id=context.run_id), postgres.pool(), rescan=True)
    counts = report.as_dict()
    metadata: dict = {k: int(v) for k, v in counts.items() if isinstance(v, int)}
    metadata["missing_sources"] = len(report.missing_sources)
    metadata["duration_seconds"] = round(time.monotonic() - started, 3)
    for problem in report.missing_sources:
        context.log.warning(problem)
    if report.missing_sources:
        metadata["missing_source_errors"] = "\n".join(report.missing_sources)
    return dg.Output(counts, metadata=metadata)


@dg.job(executor_def=dg.in_process_executor, description="Reconcile sources and the job table.")
def reconcile_job():
    reconcile_op()


HEALTH_JOB = dg.define_asset_job(
    "pipeline_health", selection=HEALTH_CHECKS,
    description="The store's health checks alone (stale vectors, dead-letter growth): whole-store queries, "
                "run on the pipeline_health_checks schedule instead of after every partition run.")


def build_schedules(settings: Settings) -> list[dg.ScheduleDefinition]:
    return [
        dg.ScheduleDefinition(
            name="reconcile_hourly", job=reconcile_job,
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
