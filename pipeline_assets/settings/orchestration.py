"""The Dagster layer's variables: the sensors, the schedules, the checks, the embeddings runs and
the partitions (``dagster_config()``)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets.defs.dagster_config import (
    DEFAULT_DLQ_GROWTH_PER_HOUR,
    DEFAULT_EMBED_RUN_DEADLINE_SECONDS,
    DEFAULT_EMBED_WORKERS,
    DEFAULT_HEALTH_CRON,
    DEFAULT_PARTITION_BUCKETS,
    DEFAULT_RECONCILE_CRON,
    DEFAULT_SOURCE_RETRY_BASE_SECONDS,
    DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS,
    DagsterConfig,
)
from pipeline_assets.settings.reading import setting


@dataclass(frozen=True)
class DagsterSettings:
    source_sensor_interval: int = setting(
        "PIPELINE_SOURCE_SENSOR_INTERVAL",
        DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS,
        "seconds between two scans of the source by the source sensor",
    )
    source_retry_base: float = setting(
        "PIPELINE_SOURCE_RETRY_BASE",
        DEFAULT_SOURCE_RETRY_BASE_SECONDS,
        "the files of a failed or cancelled source-sensor run are requested again after this long, "
        "doubling per further failure, at most an hour (s)",
    )
    reconcile_cron: str = setting("PIPELINE_RECONCILE_CRON", DEFAULT_RECONCILE_CRON, "the reconciliation schedule")
    health_cron: str = setting("PIPELINE_HEALTH_CRON", DEFAULT_HEALTH_CRON, "the asset-check schedule")
    dlq_growth_per_hour: int = setting(
        "PIPELINE_DLQ_GROWTH_PER_HOUR",
        DEFAULT_DLQ_GROWTH_PER_HOUR,
        "the dead-letter growth check warns above this many new failures per hour",
    )
    embed_workers: str = setting(
        "PIPELINE_EMBED_WORKERS",
        DEFAULT_EMBED_WORKERS,
        "`external`: Dagster embeddings runs only wait for `work` processes elsewhere",
    )
    embed_run_deadline: float = setting(
        "PIPELINE_EMBED_RUN_DEADLINE",
        DEFAULT_EMBED_RUN_DEADLINE_SECONDS,
        "an embeddings run fails (with its counts) if its chunks are not ready or failed by then (s)",
    )
    partition_buckets: int = setting(
        "PIPELINE_PARTITION_BUCKETS",
        DEFAULT_PARTITION_BUCKETS,
        "document buckets (Dagster partitions) of a new database; a database keeps the count it was first used with",
    )

    def dagster_config(self) -> DagsterConfig:
        return DagsterConfig(
            partition_buckets=self.partition_buckets,
            source_sensor_interval=self.source_sensor_interval,
            source_retry_base=self.source_retry_base,
            reconcile_cron=self.reconcile_cron,
            health_cron=self.health_cron,
            dlq_growth_per_hour=self.dlq_growth_per_hour,
            embed_workers=self.embed_workers,
            embed_run_deadline=self.embed_run_deadline,
        )
