"""`models`: list, retire, activate, index."""

from __future__ import annotations

import click

from pipeline_assets.app import model_admin
from pipeline_assets.cli.common import emit, expected_errors, fail, pool, settings


@click.group("models")
def models_group() -> None:
    """Embedding models: list them, retire one after a model change, activate it again, build its index."""


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def models_list(as_json: bool) -> None:
    """Models with their jobs and their vector index (exact search where there is none)."""
    with pool() as p:
        rows = model_admin.list_models(p)
    emit(rows, as_json, lambda rs: [f"{r['model_id']} name={r['name']} dim={r['dimension']} "
                                    f"active={r['active']} ready={r['ready']} outstanding={r['outstanding']} "
                                    f"index={r['index_detail']}"
                                    for r in rs])


@models_group.command("retire")
@click.argument("model")
@expected_errors
def models_retire(model: str) -> None:
    """Stop embedding new content with MODEL (its ready vectors are kept).

    Sticky: anything still configured with MODEL is refused until `models activate MODEL`."""
    with pool() as p:
        model_id, superseded = model_admin.retire(p, model)
    click.echo(f"retired {model_id}: {superseded} unstarted job(s) superseded")


@models_group.command("activate")
@click.argument("model")
@expected_errors
def models_activate(model: str) -> None:
    """Use a retired MODEL again: its wanted content gets jobs (the next worker bills them)."""
    with pool() as p:
        r = model_admin.activate(p, model, max_attempts=settings().max_attempts)
    if not r["was_retired"]:
        click.echo(f"{r['model_id']} is already active")
    else:
        click.echo(f"activated {r['model_id']}: {r['revived']} job(s) revived, {r['enqueued']} enqueued")


@models_group.command("index")
@click.argument("model")
@expected_errors
def models_index(model: str) -> None:
    """Build MODEL's vector index now, concurrently (workers otherwise build it when their queue drains)."""
    with pool() as p:
        try:
            r = model_admin.build_index(p, model)
        except model_admin.IndexBuildError as exc:
            fail(str(exc))
    click.echo(f"{r['model_id']}: index {r['detail']}")


COMMANDS = (models_group,)
