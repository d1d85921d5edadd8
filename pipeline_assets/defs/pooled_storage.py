"""Dagster's storage for `pipeline-assets dev`: dagster-postgres' storages, each holding its
connections in a pool (as dagster-webserver holds its own) instead of opening one per read or write.

dagster-postgres connects anew for every storage call (SQLAlchemy's NullPool) in every process but
the webserver: the daemon's loops, each sensor evaluation and each run process start a PostgreSQL
backend per query (3-4 ms of the server's CPU each, docs/benchmarks.md). Here every process keeps
``POOL_SIZE`` connections open; more at once are opened for the call and closed after it. No
statement timeout. What is stored is the same: the tables, the config schema (``postgres_url``...)
and the instance ref of dagster-postgres' ``DagsterPostgresStorage``.
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
