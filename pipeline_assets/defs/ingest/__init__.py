"""Ingest: ``documents`` and ``chunks`` by bucket, ``sync_documents``, ``sync_and_embed``,
``refresh_documents``, the source sensor and the rerun sensor."""

import dagster as dg

from pipeline_assets.app.runtime import code_versions
from pipeline_assets.defs.embeddings.assets import EMBEDDING_POOL
from pipeline_assets.defs.ingest.assets import build_ingest, source_files_spec
from pipeline_assets.defs.ingest.jobs import SYNC_JOB
from pipeline_assets.defs.ingest.refresh import refresh_job
from pipeline_assets.defs.ingest.rerun_sensor import rerun_stale_documents_sensor
from pipeline_assets.defs.ingest.source_sensor import build_source_sensor
from pipeline_assets.defs.ingest.sync_and_embed import build_sync_and_embed_job
from pipeline_assets.settings import Settings


def definitions(settings: Settings) -> dg.Definitions:
    """The domain under ``settings``: code versions, bucket count, the source sensor's interval."""
    config = settings.dagster_config()
    n = config.partition_buckets
    sync_and_embed = build_sync_and_embed_job(n, EMBEDDING_POOL if config.in_process else None)
    return dg.Definitions(
        assets=[
            source_files_spec(config.partition_buckets),
            build_ingest(code_versions(settings), config.partition_buckets),
        ],
        jobs=[SYNC_JOB, sync_and_embed, refresh_job],
        sensors=[build_source_sensor(config.source_sensor_interval, sync_and_embed), rerun_stale_documents_sensor],
    )
