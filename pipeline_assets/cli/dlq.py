"""`dlq`: the dead-letter queue: failed jobs and quarantined documents."""

from __future__ import annotations

import click

from pipeline_assets.app import status as status_uc
from pipeline_assets.cli.common import emit, expected_errors, pool


@click.group()
def dlq() -> None:
    """The dead-letter queue: failed jobs and quarantined documents."""


@dlq.command("list")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def dlq_list(as_json: bool) -> None:
    with pool() as p:
        items = status_uc.dead_letters(p)

    def lines(rows):
        if not rows:
            yield "dead-letter queue is empty"
        for r in rows:
            docs = ",".join(r["documents"][:3]) + ("…" if len(r["documents"]) > 3 else "")
            yield f"{r['kind']} {r['id']} [{r['error_class']}] {docs}: {r['message']}"
    emit(items, as_json, lines)


@dlq.command("requeue")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--all", "all_", is_flag=True, help="Requeue every failed job.")
@expected_errors
def dlq_requeue(job_ids: tuple[int, ...], all_: bool) -> None:
    if not job_ids and not all_:
        raise click.UsageError("give job ids or --all")
    with pool() as p:
        counts = status_uc.requeue(p, job_ids, all_failed=all_)
    click.echo(f"requeued={counts['pending']} superseded={counts['superseded']}")


COMMANDS = (dlq,)
