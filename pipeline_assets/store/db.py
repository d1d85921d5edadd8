"""Connections and migrations.

``database_url()`` is PIPELINE_DATABASE_URL when set (never starting a server),
otherwise the embedded server under PIPELINE_HOME. Migrations are the numbered
plain-SQL files in ``sql/``, applied in order exactly once, recorded in
``app.schema_migrations``, serialised by an advisory lock so two processes
starting at once cannot apply the same file twice.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from pgvector.psycopg import register_vector
from psycopg_pool import ConnectionPool

from pipeline_assets.store import embedded_postgres
from pipeline_assets import settings

SQL_DIR = Path(os.environ.get("PIPELINE_SQL_DIR") or Path(__file__).resolve().parents[2] / "sql")

# Arbitrary but fixed key of the advisory lock that serialises migrations.
MIGRATION_LOCK_KEY = 7_301_946_221

# How long a new connection may take before the database counts as unreachable.
CONNECT_TIMEOUT_SECONDS = 10


class DatabaseUnavailable(RuntimeError):
    """The database cannot be reached; the message is one line and holds no password."""


def redact_url(url: str) -> str:
    """A connection string fit to print: no password, in any of its forms."""
    return redact_text(url)


def redact_text(text: str) -> str:
    text = re.sub(r"(://[^:/@\s]*:)[^@\s]*@", r"\1***@", text)            # scheme://user:pass@
    text = re.sub(r"(?i)(password\s*=\s*)('[^']*'|[^\s&]+)", r"\1***", text)  # key=value / ?password=
    return text


def database_url() -> str:
    url = settings.database_url_from_env()
    if url:
        return url
    try:
        return embedded_postgres.ensure_server(settings.pipeline_home())
    except (embedded_postgres.EmbeddedServerError, OSError, subprocess.TimeoutExpired) as exc:
        raise DatabaseUnavailable(str(exc)) from None


def connect(url: str | None = None, *, autocommit: bool = True) -> psycopg.Connection:
    url = url or database_url()
    try:
        conn = psycopg.connect(url, autocommit=autocommit, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    except psycopg.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatabaseUnavailable(f"cannot connect to database {redact_url(url)}: {first}") from None
    _configure(conn)
    return conn


def _configure(conn: psycopg.Connection) -> None:
    try:
        register_vector(conn)
    except psycopg.ProgrammingError:
        # The vector extension does not exist yet (before the first migration).
        pass


def make_pool(url: str, *, min_size: int = 1, max_size: int = 8) -> ConnectionPool:
    def configure(conn: psycopg.Connection) -> None:
        conn.autocommit = True
        _configure(conn)

    pool = ConnectionPool(url, min_size=min_size, max_size=max_size, configure=configure,
                          kwargs={"connect_timeout": CONNECT_TIMEOUT_SECONDS}, open=False)
    pool.open(wait=True, timeout=CONNECT_TIMEOUT_SECONDS * 3)
    return pool


def migration_files() -> list[Path]:
    files = sorted(SQL_DIR.glob("[0-9][0-9][0-9]_*.sql"))
    if not files:
        raise RuntimeError(f"no migrations found in {SQL_DIR}")
    return files


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply pending migrations; return the names applied by this call."""
    applied: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
        conn.execute("CREATE SCHEMA IF NOT EXISTS app")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS app.schema_migrations ("
            " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r[0] for r in conn.execute("SELECT version FROM app.schema_migrations")}
        for path in migration_files():
            if path.name in done:
                continue
            conn.execute(path.read_text())
            conn.execute("INSERT INTO app.schema_migrations (version) VALUES (%s)", (path.name,))
            applied.append(path.name)
    _configure(conn)
    return applied


@contextmanager
def session(url: str | None = None) -> Iterator[psycopg.Connection]:
    """A migrated connection, closed on exit."""
    conn = connect(url)
    try:
        migrate(conn)
        yield conn
    finally:
        conn.close()
