"""PIPELINE_DATABASE_POOL_MODE=transaction: nothing is prepared server-side.

Through a transaction-pooling PgBouncer (< 1.21) a statement psycopg prepared on one server
connection is missing on the next (`prepared statement "_pg3_1" does not exist`): a worker stopped
after three such faults (the topology test, through Debian's PgBouncer 1.18). Here every connection
the pipeline opens is checked on the server itself (``pg_prepared_statements`` of its session).
"""

from __future__ import annotations

import pytest

from pipeline_assets.jobqueue.worker import Worker
from pipeline_assets.providers.local import LocalHashingProvider
from pipeline_assets.settings import Settings, SettingsError
from pipeline_assets.store import db

REPEATS = 2 * db.PREPARE_THRESHOLD


def prepared_after_repeats(conn) -> int:
    for i in range(REPEATS):
        conn.execute("SELECT %s::int + 1", (i,))
    return conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()[0]


def connections(settings: Settings):
    """(name, connection) for every way the pipeline connects: the pool, a connection of the
    pool's own (index builds, purges), a worker's own (liveness, its index build), the CLI's."""
    with db.open_pool(settings.database_config()) as pool:
        with pool.connection() as conn:
            yield "pool", conn
        with db.pool_connect(pool) as conn:
            yield "pool_connect", conn
    worker = Worker(settings.database_url or "", LocalHashingProvider(), settings.worker_config())
    with worker._connect() as conn:
        yield "worker", conn
    with db.connect(settings.database_url or "", prepare=settings.prepare) as conn:
        yield "connect", conn


@pytest.mark.parametrize("mode, prepares", [("session", True), ("transaction", False)])
def test_transaction_pool_mode_prepares_nothing(database_url, mode, prepares):
    settings = Settings.from_env({"PIPELINE_DATABASE_URL": database_url, "PIPELINE_DATABASE_POOL_MODE": mode})
    seen = {name: prepared_after_repeats(conn) for name, conn in connections(settings)}
    assert all((n > 0) == prepares for n in seen.values()), seen


def test_an_unknown_pool_mode_is_refused():
    with pytest.raises(SettingsError, match="PIPELINE_DATABASE_POOL_MODE"):
        Settings.from_env({"PIPELINE_DATABASE_POOL_MODE": "statement"})
