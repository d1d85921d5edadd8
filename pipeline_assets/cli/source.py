"""`source install-triggers` / `source uninstall-triggers`: the change log of a table source."""

from __future__ import annotations

from contextlib import closing

import click

from pipeline_assets.app.table_source import TableSource
from pipeline_assets.cli.common import expected_errors, settings
from pipeline_assets.store import change_log


@click.group()
def source() -> None:
    """A source's own setup (the change log of a `table:` source)."""


@source.command("install-triggers")
@click.argument("spec", metavar="SOURCE")
@expected_errors
def install_triggers(spec: str) -> None:
    """Create the change log of a `table:` SOURCE (schema pipeline_changes and three triggers on the
    table): inserts, updates, deletes and TRUNCATE then reach the job table without a scan."""
    with closing(TableSource(spec, settings().source_config())) as source:
        change_log.install(source.table)
    click.echo(f"change log installed on {source.spec.name}: its changes are read from pipeline_changes.log")


@source.command("uninstall-triggers")
@click.argument("spec", metavar="SOURCE")
@expected_errors
def uninstall_triggers(spec: str) -> None:
    """Drop the change log triggers of a `table:` SOURCE and its pending entries (scans find changes again)."""
    with closing(TableSource(spec, settings().source_config())) as source:
        change_log.uninstall(source.table)
    click.echo(f"change log removed from {source.spec.name}")


COMMANDS = (source,)
