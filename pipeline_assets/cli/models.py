"""`models`: list, add, serve, retire, activate, purge, index."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import click

from pipeline_assets.app import model_admin
from pipeline_assets.cli.common import emit, expected_errors, fail, pool, settings
from pipeline_assets.registry.vector_index import IndexBuildError


@click.group("models")
def models_group() -> None:
    """Embedding models: several may be active, one is served (what search and export read).

    A switch: `models add NEW` (jobs for every current chunk), workers configured with NEW embed them,
    `models serve NEW` once it covers the corpus, `models retire OLD` (its vectors are deleted by
    reconcile after PIPELINE_MODEL_RETIRE_GRACE)."""


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def models_list(as_json: bool) -> None:
    """Models with their jobs and their vector index (exact search where there is none)."""
    with pool() as p:
        rows = model_admin.list_models(p, settings().model_retire_grace)
    emit(
        rows,
        as_json,
        lambda rs: [
            f"{r['model_id']} name={r['name']} dim={r['dimension']} "
            f"active={r['active']} served={r['served']} {_coverage_or_retired(r)} "
            f"ready={r['ready']} outstanding={r['outstanding']} "
            f"index={r['index_detail']}"
            for r in rs
        ],
    )


def _coverage_or_retired(r: dict) -> str:
    if r.get("coverage"):
        return f"coverage={r['coverage']['ready']}/{r['coverage']['wanted']}"
    if r.get("purged_at"):
        return f"purged_at={r['purged_at'].isoformat(timespec='seconds')}"
    if r.get("purge_after"):
        return f"vectors_deleted_after={r['purge_after'].isoformat(timespec='seconds')}"
    return "retired"


@models_group.command("add")
@click.argument("model")
@click.option("--dimensions", type=click.IntRange(1), default=None, help="Sent as `dimensions`; part of the id.")
@click.option(
    "--dry-run", is_flag=True, help="Print what adding MODEL would send (inputs, tokens, price); change nothing."
)
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def models_add(model: str, dimensions: int | None, dry_run: bool, as_json: bool) -> None:
    """Register MODEL and enqueue every current chunk for it; search stays on the served model.

    Its jobs are done by workers configured with it: `PIPELINE_EMBEDDING_MODEL=MODEL pipeline-assets work`."""
    if dry_run:
        with pool() as p:
            est = model_admin.add_estimate(settings(), p, model, dimensions=dimensions)
        emit({**est.as_dict(), "dry_run": True}, as_json, lambda _: [est.describe()])
        return
    with pool() as p:
        r = model_admin.add(settings(), p, model, dimensions=dimensions)
    cov = r["coverage"]
    emit(
        r,
        as_json,
        lambda r: [
            f"{'added' if r['new'] else 'already registered:'} {r['model_id']}: "
            f"{r['enqueued']} job(s) enqueued, coverage {cov['ready']}/{cov['wanted']}"
            + (" (served)" if r["served"] else "")
        ],
    )


@models_group.command("serve")
@click.argument("model")
@click.option("--force", is_flag=True, help="Switch even if MODEL lacks vectors for some current chunks.")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def models_serve(model: str, force: bool, as_json: bool) -> None:
    """Switch search and export to MODEL, once it has a vector for every current chunk.

    Refused (exit 1, saying what is missing) while it does not; the served model stays."""
    with pool() as p:
        r = model_admin.serve(p, model, force=force)

    def lines(r: dict[str, Any]) -> Iterator[str]:
        if not r["changed"]:
            yield f"{r['model_id']} is already served"
        else:
            yield f"serving {r['model_id']}" + (f" (was {r['previous']})" if r["previous"] else "")
        if r["missing"]:
            yield f"warning: forced: {r['missing_detail']}; search misses them until their vectors arrive"

    emit(r, as_json, lines)


@models_group.command("retire")
@click.argument("model")
@expected_errors
def models_retire(model: str) -> None:
    """Stop embedding new content with MODEL; reconcile deletes its vectors and index after the grace period.

    Refused for the served model. Sticky: anything still configured with MODEL is refused until
    `models activate MODEL` (within the grace period its vectors are still there: no re-embedding)."""
    grace = settings().model_retire_grace
    with pool() as p:
        model_id, superseded = model_admin.retire(p, model)
    click.echo(
        f"retired {model_id}: {superseded} unstarted job(s) superseded; its vectors and index are deleted "
        f"by reconcile {grace:g} s from the retirement (PIPELINE_MODEL_RETIRE_GRACE)"
    )


@models_group.command("purge")
@expected_errors
def models_purge() -> None:
    """Now, what reconcile does: delete the vectors and index of models retired longer than the grace period."""
    with pool() as p:
        purged = model_admin.purge_expired(p, settings().model_retire_grace)
    for model_id, deleted in purged.items():
        click.echo(f"purged {model_id}: {deleted} vector(s) deleted, index dropped")
    if not purged:
        click.echo("nothing to purge")


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
            r = model_admin.build_index(p, model, settings())
        except IndexBuildError as exc:
            fail(str(exc))
    click.echo(f"{r['model_id']}: index {r['detail']}")


COMMANDS = (models_group,)
