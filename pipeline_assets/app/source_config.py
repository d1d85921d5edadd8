"""The sources' configuration: where an S3 prefix and a `table:` source are read, and how a failed
read is retried.

Defaults are the named constants beside it; ``Settings.source_config()`` builds it from the
environment. A value out of range is an ``InvalidConfig`` naming the field, in one line. The
database URLs are secrets: never in its repr.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline_assets.app.ingest_config import DEFAULT_MAX_INPUT_BYTES
from pipeline_assets.component_config import check
from pipeline_assets.jobqueue.executor_config import DEFAULT_BACKOFF_BASE_SECONDS, DEFAULT_BACKOFF_CAP_SECONDS
from pipeline_assets.store.database_config import DatabaseConfig


@dataclass(frozen=True)
class SourceConfig:
    s3_endpoint: str | None = None  # an S3-compatible endpoint (MinIO, R2, GCS); None: AWS S3
    # A failed S3 read is retried after full jitter with the provider's base and cap.
    retry_base: float = DEFAULT_BACKOFF_BASE_SECONDS
    retry_cap: float = DEFAULT_BACKOFF_CAP_SECONDS
    # The database of `table:` sources; None: the project's (``database``).
    table_database_url: str | None = field(default=None, repr=False)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    max_bytes: int = DEFAULT_MAX_INPUT_BYTES  # a row's text over it stays on the server
    crashpoint: str | None = None  # tests only: freeze at a named point (``jobqueue.crashpoints``)

    def __post_init__(self) -> None:
        check(
            self,
            [
                (self.retry_base >= 0, "retry_base", "must not be negative"),
                (self.retry_cap >= 0, "retry_cap", "must not be negative"),
                (self.max_bytes > 0, "max_bytes", "must be positive"),
            ],
        )
