"""Connections and pools.

``database_url(config)`` is PIPELINE_DATABASE_URL when set (never starting a
server), otherwise the embedded server under PIPELINE_HOME. ``open_pool``
resolves it, applies pending migrations once, and hands out a psycopg 3 pool
with pgvector's adapter registered on every connection. A connection opened with
``adapters=False`` (a process that only prepares the database) registers none, and
numpy, which the adapters need, is then never imported.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from pgvector.psycopg.vector import register_vector_info
from psycopg.types import TypeInfo
from psycopg_pool import ConnectionPool

from pipeline_assets.messages import one_line
from pipeline_assets.settings import redact_text
from pipeline_assets.store import embedded_postgres, migrations
from pipeline_assets.store.database_config import DatabaseConfig

# How long a new connection may take before the database counts as unreachable.
CONNECT_TIMEOUT_SECONDS = 10
# psycopg prepares a statement server-side on its 5th execution on a connection (its default). A
# pooler in transaction mode may run the next transaction on another server connection, which lacks
# it: ``prepare=False`` (DatabaseConfig.prepare) sends every statement unprepared.
PREPARE_THRESHOLD = 5


class DatabaseUnavailable(RuntimeError):
    """The database cannot be reached; the message is one line and holds no password."""


def database_url(config: DatabaseConfig) -> str:
    if config.url:
        return config.url
    return embedded_url(config.home)


def embedded_url(home: Path) -> str:
    """The URL of the embedded server under ``home``, started if it is not running."""
    try:
        return embedded_postgres.ensure_server(home)
    except (embedded_postgres.EmbeddedServerError, OSError, subprocess.TimeoutExpired) as exc:
        raise DatabaseUnavailable(str(exc)) from None


def _threshold(prepare: bool) -> int | None:
    return PREPARE_THRESHOLD if prepare else None


def connect(url: str, *, autocommit: bool = True, prepare: bool = True, adapters: bool = True) -> psycopg.Connection:
    try:
        conn = psycopg.connect(
            url, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_SECONDS, prepare_threshold=_threshold(prepare)
        )
    except psycopg.OperationalError as exc:
        first = one_line(exc, first=True)
        raise DatabaseUnavailable(f"cannot connect to database {redact_text(url)}: {first}") from None
    if adapters:
        _configure(conn)
    return conn


def _configure(conn: psycopg.Connection) -> None:
    from pipeline_assets.store import arrays, vectors  # numpy: only where adapters are registered

    arrays.register(conn)  # job ids and checksums in one pass
    # Only the vector type: pgvector's register_vector looks up four types (vector, bit, halfvec,
    # sparsevec), a catalog query each, on every new connection; halfvec is only cast to in SQL.
    info = TypeInfo.fetch(conn, "vector")
    if info is None:
        return  # the vector extension does not exist yet (before the first migration)
    register_vector_info(conn, info)
    vectors.register(conn)  # a completion's vectors in one numpy pass


def pool_url(pool: ConnectionPool) -> str:
    """The connection string a pool was opened with (for a connection of its own: autocommit DDL, a worker)."""
    info = pool.conninfo
    return info() if callable(info) else info


def pool_connect(pool: ConnectionPool) -> psycopg.Connection:
    """A connection of its own (autocommit) to the pool's database, preparing as the pool's do."""
    kwargs = pool.kwargs() if callable(pool.kwargs) else pool.kwargs
    return connect(pool_url(pool), prepare=(kwargs or {}).get("prepare_threshold") is not None)


def make_pool(url: str, *, min_size: int = 1, max_size: int = 8, prepare: bool = True) -> ConnectionPool:
    def configure(conn: psycopg.Connection) -> None:
        conn.autocommit = True
        _configure(conn)

    pool = ConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        configure=configure,
        kwargs={"connect_timeout": CONNECT_TIMEOUT_SECONDS, "prepare_threshold": _threshold(prepare)},
        open=False,
    )
    pool.open(wait=True, timeout=CONNECT_TIMEOUT_SECONDS * 3)
    return pool


def migrate(conn: psycopg.Connection, directory: Path | None = None, *, adapters: bool = True) -> list[str]:
    """Apply pending migrations, then (re)register the vector type on ``conn`` (``adapters``)."""
    applied = migrations.migrate(conn, directory)
    if adapters:
        _configure(conn)
    return applied


@contextmanager
def session(url: str, *, prepare: bool = True, adapters: bool = True) -> Iterator[psycopg.Connection]:
    """A migrated connection, closed on exit; ``adapters=False``: without the array and vector adapters."""
    conn = connect(url, prepare=prepare, adapters=adapters)
    try:
        migrate(conn, adapters=adapters)
        yield conn
    finally:
        conn.close()


@contextmanager
def open_pool(config: DatabaseConfig, *, max_size: int = 4, url: str | None = None) -> Iterator[ConnectionPool]:
    """A pool on the migrated pipeline database (``url`` or the config's), closed on exit."""
    url = url or database_url(config)
    with session(url, prepare=config.prepare):
        pass  # migrations applied once, before any pooled connection is handed out
    pool = make_pool(url, min_size=1, max_size=max_size, prepare=config.prepare)
    try:
        yield pool
    finally:
        pool.close()
