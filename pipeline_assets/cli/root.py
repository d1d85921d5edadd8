"""The `pipeline-assets` group: read Settings once, then hand over to a command module."""

from __future__ import annotations

import logging
import sys

import click

from pipeline_assets.cli import dlq, models, pipeline, reading, server
from pipeline_assets.settings import Settings, SettingsError


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """Idempotent embedding pipeline: documents -> chunks -> embeddings in PostgreSQL."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ctx.obj = Settings.from_env()
    except SettingsError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


for module in (pipeline, reading, dlq, models, server):
    for command in module.COMMANDS:
        main.add_command(command)
