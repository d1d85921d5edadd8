"""The Dagster layer's configuration: document buckets, the sensors' and schedules' timing, how an
embeddings run gets its chunks embedded. Imports no Dagster (``settings`` builds it).

Defaults are the named constants beside it; ``Settings.dagster_config()`` builds it from the
environment. A value out of range is an ``InvalidConfig`` naming the field, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets.component_config import check

# Document buckets: the Dagster partitions of documents, chunks and embeddings (a stable hash of
# document_id modulo this count). Fixed by the first Dagster use of a database and stored there
# (app.partition_scheme), so an edit stays in its bucket. 64 keeps 1M documents at ~16k per bucket
# and every asset far under Dagster's ~100k partitions; MAX_PARTITION_BUCKETS bounds what may be asked for.
DEFAULT_PARTITION_BUCKETS = 64
MAX_PARTITION_BUCKETS = 4096
# How often the source sensor scans the source: how long an edit waits for its run at most, against
# a walk of the source (an observation per file, read only when its size or mtime changed) per tick.
DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS = 30
# The files of a failed or cancelled source-sensor run are requested again after this long, twice
# as long after each further failure of the same bytes (at most an hour): not at every tick.
DEFAULT_SOURCE_RETRY_BASE_SECONDS = 60.0
DEFAULT_RECONCILE_CRON = "0 * * * *"
DEFAULT_HEALTH_CRON = "*/15 * * * *"
# The dead-letter growth check warns above this many new failures per hour.
DEFAULT_DLQ_GROWTH_PER_HOUR = 10
# How an embeddings run gets its partitions' chunks embedded: `in-process` starts a worker inside the
# run (the quick start); `external` only waits for `pipeline-assets work` processes elsewhere.
EMBED_WORKER_MODES = ("in-process", "external")
DEFAULT_EMBED_WORKERS = "in-process"
# The longest an embeddings run waits for the chunks of its own partitions to be ready or failed
# (retry backoffs, breaker pauses, other hosts' leases included) before it fails with the counts;
# bounds how long one run can sit in the UI, and how long it holds the `embedding_worker` pool slot.
DEFAULT_EMBED_RUN_DEADLINE_SECONDS = 3600.0


@dataclass(frozen=True)
class DagsterConfig:
    partition_buckets: int = DEFAULT_PARTITION_BUCKETS  # of a new database; a database keeps its count
    source_sensor_interval: int = DEFAULT_SOURCE_SENSOR_INTERVAL_SECONDS
    source_retry_base: float = DEFAULT_SOURCE_RETRY_BASE_SECONDS
    reconcile_cron: str = DEFAULT_RECONCILE_CRON
    health_cron: str = DEFAULT_HEALTH_CRON
    dlq_growth_per_hour: int = DEFAULT_DLQ_GROWTH_PER_HOUR
    embed_workers: str = DEFAULT_EMBED_WORKERS
    embed_run_deadline: float = DEFAULT_EMBED_RUN_DEADLINE_SECONDS

    def __post_init__(self) -> None:
        check(
            self,
            [
                (
                    1 <= self.partition_buckets <= MAX_PARTITION_BUCKETS,
                    "partition_buckets",
                    f"must be between 1 and {MAX_PARTITION_BUCKETS}",
                ),
                (self.source_sensor_interval >= 1, "source_sensor_interval", "must be at least 1"),
                (self.source_retry_base > 0, "source_retry_base", "must be positive"),
                (self.embed_workers in EMBED_WORKER_MODES, "embed_workers", f"must be one of {EMBED_WORKER_MODES}"),
                (self.embed_run_deadline > 0, "embed_run_deadline", "must be positive"),
            ],
        )

    @property
    def in_process(self) -> bool:
        """Whether an embeddings run starts its own worker."""
        return self.embed_workers == "in-process"
