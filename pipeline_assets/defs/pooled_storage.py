"""Dagster's storage for every instance we configure (`pipeline-assets dev`, `dagster-env`,
deploy/dagster.yaml): dagster-postgres' storages with their connections pooled, as dagster-webserver
pools its own, instead of one new connection per read or write.

dagster-postgres (SQLAlchemy's NullPool) starts a PostgreSQL backend for every storage call (B20:
several ms of the server's CPU each, docs/benchmarks.md), in the daemon's loops, sensor
evaluations and runs. Here each storage of a process holds one connection; calls beside it (up to
``POOL_OVERFLOW``) open one and close it after. No statement timeout. The tables, the config
(``postgres_url``...) and the instance ref are dagster-postgres' own. As in the webserver, a held
connection that a PostgreSQL restart closed fails the one call that finds it; SQLAlchemy then
replaces the pool's connections.
"""

from collections.abc import Mapping
from typing import Any

from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.utils import get_token_provider_from_config, pg_url_from_config

# Seconds after which a held connection is replaced (a server restart or a proxy's idle cut).
POOL_RECYCLE_SECONDS = 3600
# Connections opened beyond the pooled one while other threads of the process hold it.
POOL_OVERFLOW = 10


class PooledPostgresStorage(DagsterPostgresStorage):
    """``DagsterPostgresStorage`` whose run, event-log and schedule storages pool their connections."""

    @classmethod
    def from_config_value(cls, inst_data: Any, config_value: Mapping[str, Any]) -> "PooledPostgresStorage":
        storage = cls(
            inst_data=inst_data,
            postgres_url=pg_url_from_config(config_value),
            should_autocreate_tables=config_value.get("should_autocreate_tables", True),
            token_provider=get_token_provider_from_config(config_value),
        )
        for part in (storage.run_storage, storage.event_log_storage, storage.schedule_storage):
            part.optimize_for_webserver(
                statement_timeout=0, pool_recycle=POOL_RECYCLE_SECONDS, max_overflow=POOL_OVERFLOW
            )
        return storage
