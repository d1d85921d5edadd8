"""The `pipeline-assets` group: read Settings once, then hand over to a command module."""

from __future__ import annotations

import sys

import click

from pipeline_assets.cli import dlq, logs, models, pipeline, reading, server
from pipeline_assets.settings import Settings, SettingsError


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
@click.option("--log-format", type=click.Choice(logs.FORMATS), default="auto", show_default=True,
              help="Log lines on stderr: JSON (auto: when stderr is not a terminal) or readable text.")
@click.pass_context
def main(ctx: click.Context, verbose: bool, log_format: str) -> None:
    """Idempotent embedding pipeline: documents -> chunks -> embeddings in PostgreSQL."""
    logs.configure(log_format, verbose)
    try:
        ctx.obj = Settings.from_env()
    except SettingsError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


for module in (pipeline, reading, dlq, models, server):
    for command in module.COMMANDS:
        main.add_command(command)
