"""The `pipeline-assets` group: read Settings once, then hand over to a command module.

The command modules are imported when their command runs (``LazyGroup``): a
command does not pay for the imports of the others (the search and worker
stacks, rich's progress display), so each invocation starts sooner.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from pipeline_assets.cli import logs, process_exit
from pipeline_assets.settings import Settings, SettingsError

# Each top-level command and the module (pipeline_assets.cli.<module>) whose COMMANDS hold it;
# test_cli keeps this in step with the modules.
COMMAND_MODULES = {
    "migrate": "database",
    "roles": "database",
    "rerun": "rerun",
    "ingest": "pipeline",
    "work": "pipeline",
    "embed": "pipeline",
    "reconcile": "pipeline",
    "status": "reading",
    "search": "reading",
    "export": "reading",
    "settings": "reading",
    "dlq": "dlq",
    "models": "models",
    "stop-db": "server",
    "dev": "server",
    "dagster-env": "server",
    "source": "source",
}
# Commands that extract documents: the extraction children's server starts while they import.
EXTRACTING = ("embed", "ingest")


def module_commands(module: str) -> dict[str, click.Command]:
    """The commands a command module defines, by name."""
    commands = importlib.import_module(f"pipeline_assets.cli.{module}").COMMANDS
    return {command.name: command for command in commands if command.name}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use (``--help`` imports them all)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMAND_MODULES)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        if args and args[0] in EXTRACTING:
            from pipeline_assets.content.server_process import start_server_soon

            start_server_soon()
        return super().resolve_command(ctx, args)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Run the command. As the process's own entry (arguments from sys.argv, standalone), the
        process then ends without the interpreter's teardown (``process_exit.end``); a caller that
        passes the arguments (a test's CliRunner) gets click's own exit."""
        try:
            return super().main(args, prog_name, complete_var, standalone_mode=standalone_mode, **extra)
        except SystemExit as exc:
            if args is not None or not standalone_mode:
                raise
            process_exit.end(exc.code)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMAND_MODULES.get(cmd_name)
        return module_commands(module).get(cmd_name) if module else None


@click.group(cls=LazyGroup)
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
@click.option(
    "--log-format",
    type=click.Choice(logs.FORMATS),
    default="auto",
    show_default=True,
    help="Log lines on stderr: JSON (auto: when stderr is not a terminal) or readable text.",
)
@click.pass_context
def main(ctx: click.Context, verbose: bool, log_format: str) -> None:
    """Idempotent embedding pipeline: documents -> chunks -> embeddings in PostgreSQL."""
    logs.configure(log_format, verbose)
    try:
        ctx.obj = Settings.from_env()
    except SettingsError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
