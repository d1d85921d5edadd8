"""The pipeline's own commands: migrate, roles, ingest, work, embed, reconcile, rerun."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from pipeline_assets.app import embed as embed_uc
from pipeline_assets.app import ingest as ingest_uc
from pipeline_assets.app import reconcile as reconcile_uc
from pipeline_assets.app import rerun as rerun_uc
from pipeline_assets.app.source_registry import open_source
from pipeline_assets.cli.common import emit, expected_errors, fail, pairs, pool, runtime, settings, stop_on_signals
from pipeline_assets.cli.progress import work_progress
from pipeline_assets.jobs.worker_config import DEFAULT_CONCURRENCY
from pipeline_assets.store import db
from pipeline_assets.store import roles as db_roles

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from pipeline_assets.app.metrics import WorkMetrics
    from pipeline_assets.app.runtime import Runtime
    from pipeline_assets.jobs.worker import Worker
    from pipeline_assets.store.stage_runs import RerunTarget


@click.command()
@expected_errors
def migrate() -> None:
    """Apply pending SQL migrations."""
    config = settings().database_config()
    conn = db.connect(db.database_url(config), prepare=config.prepare)
    applied = db.migrate(conn)
    click.echo(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied else ""))


@click.command()
@click.option("--owner", default=db_roles.DEFAULT_OWNER_ROLE, show_default=True,
              help="The role that owns the schema and runs `migrate` (DDL).")
@click.option("--worker", default=db_roles.DEFAULT_WORKER_ROLE, show_default=True,
              help="The role of `work`, `ingest`, Dagster: rows only, no DDL.")
@click.option("--reader", default=db_roles.DEFAULT_READER_ROLE, show_default=True,
              help="A read-only role (`status`, dashboards, the KEDA trigger).")
@click.option("--print", "print_only", is_flag=True, help="Print the statements instead of running them.")
@expected_errors
def roles(owner: str, worker: str, reader: str, print_only: bool) -> None:
    """Create the least-privilege roles and their grants (run as an administrator, before `migrate`)."""
    names = db_roles.RoleNames(owner, worker, reader)
    conn = db.connect(db.database_url(settings().database_config()))
    database = conn.info.dbname
    try:
        if print_only:
            for statement in [*map(db_roles.create_statement, names.all()),
                              *db_roles.grant_statements(names, database)]:
                click.echo(statement.as_string(conn) + ";")
            return
        created = db_roles.apply(conn, names)
    finally:
        conn.close()
    click.echo(f"roles owner={owner} worker={worker} reader={reader} granted on database {database}"
               + (f"; created {', '.join(created)} (LOGIN, no password: set one with psql's \\password)"
                  if created else ""))


@click.command()
@click.argument("source")
@click.option("--allow-empty", is_flag=True, help="Allow an empty source to tombstone all its documents.")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def ingest(source: str, allow_empty: bool, as_json: bool) -> None:
    """Scan, checksum, extract, chunk and enqueue SOURCE (a directory, s3://BUCKET/PREFIX). No provider calls."""
    rt = runtime(allow_empty=allow_empty)
    src = open_source(source, settings().source_config())
    with pool() as p:
        report = ingest_uc.ingest_source(rt, p, src)
    emit(report.as_dict(), as_json, pairs)


@click.command()
@click.option("--concurrency", default=None, type=click.IntRange(1, 256), help="Requests in flight.")
@click.option("--until-idle", is_flag=True, help="Exit when no work is claimable, waiting or leased.")
@click.option("--lease-seconds", type=click.FloatRange(0.5, 3600), default=None)
@click.option("--worker-id", default=None)
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on this port (/metrics) while working.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address the metrics server binds.")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def work(concurrency: int | None, until_idle: bool, lease_seconds: float | None, worker_id: str | None,
         metrics_port: int | None, metrics_host: str, as_json: bool) -> None:
    """Claim and process embedding jobs (until SIGTERM, or --until-idle)."""
    rt = runtime()
    with pool() as p, work_progress(p, enabled=None if until_idle else False) as bar:
        metrics = None if metrics_port is None else _serve_metrics(rt, p, metrics_host, metrics_port)

        def observe(worker: Worker) -> None:  # the worker, once built: its counters are read, nothing is pushed
            bar.observe(worker)
            if metrics is not None:
                metrics.observe(worker)
        report = embed_uc.work(rt, p, concurrency=concurrency or DEFAULT_CONCURRENCY, until_idle=until_idle,
                               lease_seconds=lease_seconds, worker_id=worker_id, stop_event=stop_on_signals(),
                               observe=observe)
    emit(report.as_dict(), as_json, pairs)


def _serve_metrics(rt: Runtime, p: ConnectionPool, host: str, port: int) -> WorkMetrics:
    """Serve /metrics for this process, its provider calls counted from now on."""
    from pipeline_assets.app.metrics import WorkMetrics  # prometheus_client: only when metrics are served

    metrics = WorkMetrics(p)
    rt.provider = metrics.wrap(rt.provider)
    bound_host, bound_port = metrics.serve(port, host)
    logging.getLogger(__name__).info("metrics on http://%s:%d/metrics", bound_host, bound_port)
    return metrics


@click.command()
@click.argument("source")
@click.option("--concurrency", default=None, type=click.IntRange(1, 256))
@click.option("--allow-empty", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def embed(source: str, concurrency: int | None, allow_empty: bool, as_json: bool) -> None:
    """Ingest SOURCE (a directory, s3://BUCKET/PREFIX), then work until idle: the one-shot job."""
    rt = runtime(allow_empty=allow_empty)
    src = open_source(source, settings().source_config())
    with pool() as p, work_progress(p) as bar:
        summary = embed_uc.embed_directory(rt, p, src,
                                           concurrency=concurrency or DEFAULT_CONCURRENCY,
                                           stop_event=stop_on_signals(), observe=bar.observe)
    emit(summary.as_dict(), as_json, pairs)


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-rescan", is_flag=True, help="Skip re-scanning sources; only repair the job table.")
@expected_errors
def reconcile(as_json: bool, no_rescan: bool) -> None:
    """Re-scan ingested sources and repair the job table to match."""
    rt = runtime()
    with pool() as p:
        report = reconcile_uc.reconcile_all(rt, p, rescan=not no_rescan)
    emit(report.as_dict(), as_json, pairs)


@click.command()
@click.option("--stage", type=click.Choice(rerun_uc.RERUN_STAGES), default="extract", show_default=True,
              help="extract/chunk re-ingest the documents; embed requeues their failed jobs and enqueues the "
                   "missing ones for the current model (ready vectors are never sent again).")
@click.option("--status", "statuses", multiple=True, type=click.Choice(rerun_uc.STATUSES),
              help="Only items whose stage has this status (repeatable).")
@click.option("--error-class", default=None, help="Only items that failed with this error class.")
@click.option("--stale", is_flag=True, help="Only items produced by another code version than the current one "
                                            "(the extractor's is per format). extract and chunk only.")
@click.option("--before-version", default=None, metavar="V",
              help="Only items produced by an older version than V (same name, smaller final number: "
                   "extract-1 is before extract-2). extract and chunk only.")
@click.option("--document", "documents", multiple=True, metavar="GLOB",
              help="Only documents whose id matches (* and ?; * crosses /; repeatable).")
@click.option("--dry-run", is_flag=True, help="List what would be rerun and, for embed, what it would send "
                                            "(inputs, tokens, price); change nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: the documents and the estimate as JSON.")
@expected_errors
def rerun(stage: str, statuses: tuple[str, ...], error_class: str | None, stale: bool,
          before_version: str | None, documents: tuple[str, ...], dry_run: bool, as_json: bool) -> None:
    """Re-run a stage for the documents a query selects (a partial rerun); the filters combine."""
    if as_json and not dry_run:
        fail("--json goes with --dry-run (a rerun prints one summary line)")
    rt = runtime()
    with pool() as p:
        # Every target, a page at a time: each page is rerun before the next is read.
        pages = rerun_uc.pages(rt, p, stages_=(stage,), error_class=error_class, stale=stale,
                               statuses=statuses, before_version=before_version, documents=documents)
        if dry_run:
            _rerun_dry_run(rt, p, stage, pages, as_json)
            return
        if stage == "embed":
            done = rerun_uc.EmbedRerun(0, 0, 0)
            for page in pages:
                done = done + rerun_uc.rerun_embed(rt, p, page)
            click.echo(f"reran embed for {done.documents} document(s): requeued={done.requeued} "
                       f"enqueued={done.enqueued} (`pipeline-assets work --until-idle` embeds them)")
            return
        total = sum(rerun_uc.rerun(rt, p, page) for page in pages)
    click.echo(f"reran {stage} for {total} document(s)")


def _rerun_dry_run(rt: Runtime, p: ConnectionPool, stage: str, pages: Iterable[list[RerunTarget]],
                   as_json: bool) -> None:
    """The targets, and for the embed stage the estimate of what the rerun and the work after it
    would send (the extract and chunk stages' chunks are known only once re-chunked)."""
    listed: list[dict] = []
    count = 0
    pks: list[int] = []
    for page in pages:
        for t in page:
            if as_json:
                listed.append({"document_id": t.document_id, "stage": t.stage, "status": t.status,
                               "error_class": t.error_class, "code_version": t.code_version})
            else:
                click.echo(f"{t.document_id} [{t.stage} {t.status} {t.error_class or '-'} {t.code_version}]")
        count += len(page)
        if stage == "embed":
            pks += rerun_uc.current_pks(p, page)
    est = rerun_uc.estimate_embed(rt, p, pks) if stage == "embed" else None
    if as_json:
        click.echo(json.dumps({"dry_run": True, "documents": listed, "count": count,
                               "estimate": est.as_dict() if est else None}, indent=2, default=str))
        return
    click.echo(f"{count} document(s) would be rerun")
    if est is not None:
        click.echo(est.describe())
    else:   # ingest sends nothing: what it enqueues can be estimated before `work` sends it
        click.echo("estimate: none before re-chunking; this rerun only enqueues, and `rerun --stage embed "
                   "--dry-run` then says what `work` would send")


COMMANDS = (migrate, roles, ingest, work, embed, reconcile, rerun)
