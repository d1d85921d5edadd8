"""The database's own commands: migrate (the schema) and roles (least-privilege roles and grants)."""

from __future__ import annotations

import click

from pipeline_assets.cli.common import expected_errors, settings
from pipeline_assets.store import db
from pipeline_assets.store import roles as db_roles


@click.command()
@expected_errors
def migrate() -> None:
    """Apply pending SQL migrations."""
    config = settings().database_config()
    conn = db.connect(db.database_url(config), prepare=config.prepare)
    applied = db.migrate(conn)
    click.echo(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied else ""))


@click.command()
@click.option(
    "--owner",
    default=db_roles.DEFAULT_OWNER_ROLE,
    show_default=True,
    help="The role that owns the schema and runs `migrate` (DDL).",
)
@click.option(
    "--worker",
    default=db_roles.DEFAULT_WORKER_ROLE,
    show_default=True,
    help="The role of `work`, `ingest`, Dagster: rows only, no DDL.",
)
@click.option(
    "--reader",
    default=db_roles.DEFAULT_READER_ROLE,
    show_default=True,
    help="A read-only role (`status`, dashboards, the KEDA trigger).",
)
@click.option("--print", "print_only", is_flag=True, help="Print the statements instead of running them.")
@expected_errors
def roles(owner: str, worker: str, reader: str, print_only: bool) -> None:
    """Create the least-privilege roles and their grants (run as an administrator, before `migrate`)."""
    names = db_roles.RoleNames(owner, worker, reader)
    conn = db.connect(db.database_url(settings().database_config()))
    database = conn.info.dbname
    try:
        if print_only:
            for statement in [
                *map(db_roles.create_statement, names.all()),
                *db_roles.grant_statements(names, database),
            ]:
                click.echo(statement.as_string(conn) + ";")
            return
        created = db_roles.apply(conn, names)
    finally:
        conn.close()
    click.echo(
        f"roles owner={owner} worker={worker} reader={reader} granted on database {database}"
        + (f"; created {', '.join(created)} (LOGIN, no password: set one with psql's \\password)" if created else "")
    )


COMMANDS = (migrate, roles)
