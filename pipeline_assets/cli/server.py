"""Servers: the embedded PostgreSQL (`stop-db`) and Dagster (`dev`, `dagster-env`).

`dev` stays up as long as Dagster does, so this module imports only what `dev` uses: not
``cli.common`` (the worker's stack and numpy come with it), which `stop-db` imports when it runs.
"""

from __future__ import annotations

import sys

import click

from pipeline_assets.settings import Settings
from pipeline_assets.store import embedded_postgres


def settings() -> Settings:
    """The Settings the root group read once (``cli.common.settings``, without importing ``cli.common``)."""
    return click.get_current_context().find_root().obj


@click.command("stop-db")
def stop_db() -> None:
    """Stop the embedded PostgreSQL under PIPELINE_HOME (it otherwise outlives every command)."""
    from pipeline_assets.cli.common import expected_errors

    expected_errors(_stop_db)()


def _stop_db() -> None:
    s = settings()
    home = s.home_path
    if s.database_url:
        click.echo("PIPELINE_DATABASE_URL is set: no embedded server is managed here")
    elif embedded_postgres.stop_server(home):
        click.echo(f"stopped the embedded PostgreSQL in {home}")
    else:
        click.echo(f"no embedded PostgreSQL running in {home}")


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=3000, show_default=True, type=click.IntRange(1, 65535))
def dev(host: str, port: int) -> None:
    """Start the Dagster UI and daemon on the embedded (or configured) database."""
    from pipeline_assets.cli.devserver import run_dev

    sys.exit(run_dev(settings(), host=host, port=port))


@click.command("dagster-env")
def dagster_env() -> None:
    """Print the environment (export lines) that points Dagster's own commands at `dev`'s instance."""
    from pipeline_assets.cli.devserver import run_dagster_env

    sys.exit(run_dagster_env(settings()))


COMMANDS = (stop_db, dev, dagster_env)
