"""`rerun`: re-run a stage for the documents a query selects, or say what it would do (--dry-run)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from pipeline_assets.app import rerun as rerun_uc
from pipeline_assets.cli.common import expected_errors, fail, pool, runtime

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from pipeline_assets.app.runtime import Runtime
    from pipeline_assets.store.stage_runs import RerunTarget


@click.command()
@click.option(
    "--stage",
    type=click.Choice(rerun_uc.RERUN_STAGES),
    default="extract",
    show_default=True,
    help="extract/chunk re-ingest the documents; embed requeues their failed jobs and enqueues the "
    "missing ones for the current model (ready vectors are never sent again).",
)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(rerun_uc.STATUSES),
    help="Only items whose stage has this status (repeatable).",
)
@click.option("--error-class", default=None, help="Only items that failed with this error class.")
@click.option(
    "--stale",
    is_flag=True,
    help="Only items produced by another code version than the current one "
    "(the extractor's is per format). extract and chunk only.",
)
@click.option(
    "--before-version",
    default=None,
    metavar="V",
    help="Only items produced by an older version than V (same name, smaller final number: "
    "extract-1 is before extract-2). extract and chunk only.",
)
@click.option(
    "--document",
    "documents",
    multiple=True,
    metavar="GLOB",
    help="Only documents whose id matches (* and ?; * crosses /; repeatable).",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="List what would be rerun and, for embed, what it would send (inputs, tokens, price); change nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the documents and the estimate as JSON.")
@expected_errors
def rerun(
    stage: str,
    statuses: tuple[str, ...],
    error_class: str | None,
    stale: bool,
    before_version: str | None,
    documents: tuple[str, ...],
    dry_run: bool,
    as_json: bool,
) -> None:
    """Re-run a stage for the documents a query selects (a partial rerun); the filters combine."""
    if as_json and not dry_run:
        fail("--json goes with --dry-run (a rerun prints one summary line)")
    rt = runtime()
    with pool() as p:
        # Every target, a page at a time: each page is rerun before the next is read.
        pages = rerun_uc.pages(
            rt,
            p,
            stages_=(stage,),
            error_class=error_class,
            stale=stale,
            statuses=statuses,
            before_version=before_version,
            documents=documents,
        )
        if dry_run:
            _rerun_dry_run(rt, p, stage, pages, as_json)
            return
        if stage == "embed":
            done = rerun_uc.EmbedRerun(0, 0, 0)
            for page in pages:
                done = done + rerun_uc.rerun_embed(rt, p, page)
            click.echo(
                f"reran embed for {done.documents} document(s): requeued={done.requeued} "
                f"enqueued={done.enqueued} (`pipeline-assets work --until-idle` embeds them)"
            )
            return
        total = sum(rerun_uc.rerun(rt, p, page) for page in pages)
    click.echo(f"reran {stage} for {total} document(s)")


def _rerun_dry_run(
    rt: Runtime, p: ConnectionPool, stage: str, pages: Iterable[list[RerunTarget]], as_json: bool
) -> None:
    """The targets, and for the embed stage the estimate of what the rerun and the work after it
    would send (the extract and chunk stages' chunks are known only once re-chunked)."""
    listed: list[dict] = []
    count = 0
    pks: list[int] = []
    for page in pages:
        for t in page:
            if as_json:
                listed.append(
                    {
                        "document_id": t.document_id,
                        "stage": t.stage,
                        "status": t.status,
                        "error_class": t.error_class,
                        "code_version": t.code_version,
                    }
                )
            else:
                click.echo(f"{t.document_id} [{t.stage} {t.status} {t.error_class or '-'} {t.code_version}]")
        count += len(page)
        if stage == "embed":
            pks += rerun_uc.current_pks(p, page)
    est = rerun_uc.estimate_embed(rt, p, pks) if stage == "embed" else None
    if as_json:
        click.echo(
            json.dumps(
                {"dry_run": True, "documents": listed, "count": count, "estimate": est.as_dict() if est else None},
                indent=2,
                default=str,
            )
        )
        return
    click.echo(f"{count} document(s) would be rerun")
    if est is not None:
        click.echo(est.describe())
    else:  # ingest sends nothing: what it enqueues can be estimated before `work` sends it
        click.echo(
            "estimate: none before re-chunking; this rerun only enqueues, and `rerun --stage embed "
            "--dry-run` then says what `work` would send"
        )


COMMANDS = (rerun,)
