"""Migrations: the numbered plain-SQL files in ``sql/``, applied in order exactly once.

Each applied file is recorded in ``app.schema_migrations``; an advisory lock
serialises the whole step, so two processes starting at once cannot apply the
same file twice.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import psycopg
from psycopg import sql

from pipeline_assets.messages import one_line
from pipeline_assets.store import queries

# Arbitrary but fixed key of the advisory lock that serialises migrations.
MIGRATION_LOCK_KEY = 7_301_946_221

MIGRATIONS = queries.load("migrations")


def migration_files(directory: Path | None = None) -> list[Path]:
    directory = directory or queries.sql_dir()
    files = sorted(directory.glob("[0-9][0-9][0-9]_*.sql"))
    if not files:
        raise RuntimeError(f"no migrations found in {directory}")
    return files


class MigrationRefused(RuntimeError):
    """Migrations are pending and this role may not apply them (a worker or reader role of
    ``pipeline-assets roles``); the message is one line naming what to run."""


def migrate(conn: psycopg.Connection, directory: Path | None = None) -> list[str]:
    """Apply pending migrations; return the names applied by this call.

    Raises MigrationRefused when some are pending and the role lacks the privileges (DDL) to
    apply them: the owner role's `pipeline-assets migrate` has not run for this release yet.
    """
    applied: list[str] = []
    if _up_to_date(conn, directory):
        return applied  # read-only: a role with only SELECT (``status``) gets this far
    try:
        with conn.transaction():
            conn.execute(MIGRATIONS.lock, {"key": MIGRATION_LOCK_KEY})
            conn.execute(MIGRATIONS.create_schema)
            conn.execute(MIGRATIONS.create_ledger)
            done = {r[0] for r in conn.execute(MIGRATIONS.applied)}
            for path in migration_files(directory):
                if path.name in done:
                    continue
                conn.execute(path.read_text(encoding="utf-8"))
                conn.execute(MIGRATIONS.record, {"version": path.name})
                applied.append(path.name)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise MigrationRefused(
            f"the database is not migrated to this release and role {conn.info.user} may not "
            f"migrate it ({one_line(exc, first=True)}): run `pipeline-assets migrate` as the schema's owner role "
            "first"
        ) from None
    return applied


def _up_to_date(conn: psycopg.Connection, directory: Path | None) -> bool:
    """Every migration file already applied (checked with reads only, before any lock or DDL)."""
    with conn.transaction():
        if not queries.scalar(conn, MIGRATIONS.ledger_exists):
            return False
        done = {r[0] for r in conn.execute(MIGRATIONS.applied)}
    return all(path.name in done for path in migration_files(directory))


def ensure_database(server_url: str, name: str, *, connect_timeout: int = 10) -> str:
    """CREATE DATABASE name on the server of ``server_url`` if missing; return its libpq URL."""
    with psycopg.connect(server_url, autocommit=True, connect_timeout=connect_timeout) as conn:
        if conn.execute(MIGRATIONS.database_exists, {"name": name}).fetchone() is None:
            with contextlib.suppress(psycopg.errors.DuplicateDatabase):  # created concurrently
                conn.execute(sql.SQL(MIGRATIONS.create_database).format(name=sql.Identifier(name)))
    return psycopg.conninfo.make_conninfo(server_url, dbname=name)
