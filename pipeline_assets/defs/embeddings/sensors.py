"""``embed_after_sync``: a bucket run is followed by the embeddings run of its buckets.

Each successful bucket run (``sync_documents``, or the UI's "Materialize" of documents and
chunks; never a backfill's run) gets ONE ``embed_documents`` run over its buckets x every
active model (the served one and one being backfilled alike), after the model keys are made
the registry's active models (``models/partitions.py``). The run key is the sync run's id, so
a re-evaluated tick launches nothing twice; the run keeps the sync run's trigger tags, so the
sensor that asked for the sync counts it as its own (backpressure). The cursor is the update
time of the last sync run handled; without one, the latest sync run only.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import dagster as dg

from pipeline_assets.app import model_admin
from pipeline_assets.defs.embeddings.jobs import EMBED_JOB
from pipeline_assets.defs.keys import CHUNKS, EMBEDDINGS
from pipeline_assets.defs.models.partitions import model_keys
from pipeline_assets.defs.partitions import bucket_index, embedding_key
from pipeline_assets.defs.resources import PostgresResource
from pipeline_assets.defs.run_requests import (
    EMBED_JOB_NAME,
    GENERATION_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    RERUN_TAG,
    SYNC_JOB_NAME,
    TRIGGER_TAG,
    run_span,
)

SENSOR_NAME = "embed_after_sync"
# Seconds between ticks: how long a finished bucket run waits for its embeddings run, at most.
EMBED_SENSOR_INTERVAL_SECONDS = 5
# Successful sync runs one tick reads (the source and rerun sensors launch one at a time).
SYNC_RUNS_PER_TICK = 20
AFTER_RUN_TAG = "pipeline/after_run"
BACKFILL_TAG = "dagster/backfill"
# The jobs whose bucket runs are followed: ours, and the asset job the UI's "Materialize" launches.
CHAINED_JOBS = (SYNC_JOB_NAME, "__ASSET_JOB")
# Tags of the sync run its embeddings run keeps (whose run it is, for the sensors' backpressure).
KEPT_TAGS = (TRIGGER_TAG, RERUN_TAG, GENERATION_TAG)


def chains(run: dg.DagsterRun) -> bool:
    """Whether a successful run is a bucket run whose embeddings run this sensor requests: a
    ``sync_documents`` run, or a materialization of documents and chunks from the UI (the asset
    job) without embeddings; never a backfill's run (the backfill runs its embeddings itself)."""
    if BACKFILL_TAG in run.tags:
        return False
    if run.job_name == SYNC_JOB_NAME:
        return True
    selected = run.asset_selection or frozenset()
    return CHUNKS in selected and EMBEDDINGS not in selected


def embed_request(run: dg.DagsterRun, models: Sequence[str]) -> dg.RunRequest | None:
    """The embeddings run after a sync run: its buckets x ``models`` (in partition order)."""
    span = run_span(run)  # its bucket keys
    if span is None or not models:
        return None
    first, last = span
    bucket_index(first), bucket_index(last)  # bucket keys, or a ValueError
    tags = {k: run.tags[k] for k in KEPT_TAGS if k in run.tags}
    tags[AFTER_RUN_TAG] = run.run_id
    start, end = embedding_key(first, models[0]), embedding_key(last, models[-1])
    if start == end:
        return dg.RunRequest(
            run_key=f"embed-after:{run.run_id}", partition_key=start, tags=tags, job_name=EMBED_JOB_NAME
        )
    return dg.RunRequest(
        run_key=f"embed-after:{run.run_id}",
        job_name=EMBED_JOB_NAME,
        tags={**tags, RANGE_START_TAG: str(start), RANGE_END_TAG: str(end)},
    )


@dg.sensor(
    name=SENSOR_NAME,
    job=EMBED_JOB,
    minimum_interval_seconds=EMBED_SENSOR_INTERVAL_SECONDS,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="After each successful sync_documents run: one embed_documents run over its buckets x "
    "every active model (only content without a vector for a model is sent). Keeps the "
    "model partitions the registry's active models.",
)
def embed_after_sync(context: dg.SensorEvaluationContext, postgres: PostgresResource) -> dg.SensorResult:
    after = float(context.cursor) if context.cursor else None
    runs = [
        record
        for job in CHAINED_JOBS
        for record in context.instance.get_run_records(
            dg.RunsFilter(
                job_name=job,
                statuses=[dg.DagsterRunStatus.SUCCESS],
                updated_after=datetime.datetime.fromtimestamp(after, datetime.UTC) if after else None,
            ),
            limit=SYNC_RUNS_PER_TICK if after else 1,
            order_by="update_timestamp",
            ascending=after is not None,
        )
    ]
    requests, models = model_keys(context.instance, model_admin.active_model_ids(postgres.pool()))
    run_requests = [
        r
        for record in sorted(runs, key=lambda rec: rec.update_timestamp)
        if chains(record.dagster_run) and (r := embed_request(record.dagster_run, models)) is not None
    ]
    newest = max((record.update_timestamp.timestamp() for record in runs), default=after)
    if not run_requests:
        return dg.SensorResult(
            dynamic_partitions_requests=requests,
            cursor=str(newest) if newest else context.cursor,
            skip_reason=f"no finished sync run to embed after ({len(models)} model(s))",
        )
    context.log.info(f"{len(run_requests)} embeddings run(s) over {len(models)} model(s): {', '.join(models)}")
    return dg.SensorResult(
        run_requests=run_requests, dynamic_partitions_requests=requests, cursor=str(newest) if newest else None
    )
