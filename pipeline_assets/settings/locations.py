"""Where things are: the database (``database_config()``), the embedded server's home, the sources."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline_assets.settings.reading import setting
from pipeline_assets.store.database_config import DEFAULT_HOME, DEFAULT_POOL_MODE, DatabaseConfig


@dataclass(frozen=True)
class LocationSettings:
    database_url: str | None = setting(
        "PIPELINE_DATABASE_URL",
        None,
        "PostgreSQL with pgvector; when set, no server is ever started",
        secret=True,
        shown_default="unset: embedded server under `PIPELINE_HOME`",
    )
    home: Path = setting(
        "PIPELINE_HOME", DEFAULT_HOME, "embedded server data (and `dev`'s DAGSTER_HOME)", shown_default="`./.pipeline`"
    )
    source_dir: str = setting("PIPELINE_SOURCE_DIR", "examples/corpus", "the directory the Dagster sensors watch")
    source: str | None = setting(
        "PIPELINE_SOURCE",
        None,
        "the source the Dagster sensors watch: a folder, `s3://BUCKET/PREFIX` or `table:...`",
        shown_default="`PIPELINE_SOURCE_DIR`",
    )
    aws_endpoint_url: str | None = setting(
        "AWS_ENDPOINT_URL", None, "S3-compatible endpoint (MinIO, R2, GCS)", shown_default="AWS S3"
    )
    source_database_url: str | None = setting(
        "PIPELINE_SOURCE_DATABASE_URL",
        None,
        "the database of `table:` sources",
        secret=True,
        shown_default="unset: the project's database",
    )
    database_pool_mode: str = setting(
        "PIPELINE_DATABASE_POOL_MODE",
        DEFAULT_POOL_MODE,
        "`transaction`: the URL is a transaction-pooling PgBouncer (< 1.21); nothing is prepared server-side",
    )
    dagster_database: str = setting(
        "PIPELINE_DAGSTER_DATABASE",
        "dagster",
        "database for Dagster's own storage, created by `dev` on the same server",
    )

    @property
    def home_path(self) -> Path:
        return Path(self.home).expanduser().resolve()

    @property
    def prepare(self) -> bool:
        """Whether statements may be prepared server-side (not through a transaction pooler)."""
        return DatabaseConfig(pool_mode=self.database_pool_mode).prepare

    def database_config(self) -> DatabaseConfig:
        return DatabaseConfig(url=self.database_url, home=self.home_path, pool_mode=self.database_pool_mode)
