"""The pipeline's own commands: migrate, ingest, work, embed, reconcile, rerun."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from pipeline_assets.app import embed as embed_uc
from pipeline_assets.app import ingest as ingest_uc
from pipeline_assets.app import reconcile as reconcile_uc
from pipeline_assets.app import rerun as rerun_uc
from pipeline_assets.app.metrics import WorkMetrics
from pipeline_assets.cli.common import emit, expected_errors, pairs, pool, runtime, settings, stop_on_signals
from pipeline_assets.cli.progress import work_progress
from pipeline_assets.settings import DEFAULT_CONCURRENCY
from pipeline_assets.store import db


@click.command()
@expected_errors
def migrate() -> None:
    """Apply pending SQL migrations."""
    conn = db.connect(db.database_url(settings()), prepare=settings().prepare)
    applied = db.migrate(conn)
    click.echo(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied else ""))


@click.command()
@click.argument("directory")
@click.option("--allow-empty", is_flag=True, help="Allow an empty source to tombstone all its documents.")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def ingest(directory: str, allow_empty: bool, as_json: bool) -> None:
    """Scan, checksum, extract, chunk and enqueue DIRECTORY. No provider calls."""
    rt = runtime(allow_empty=allow_empty)
    with pool() as p:
        report = ingest_uc.ingest_source(rt, p, Path(directory))
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

        def observe(worker) -> None:  # the worker, once built: its counters are read, nothing is pushed
            bar.observe(worker)
            if metrics is not None:
                metrics.observe(worker)
        report = embed_uc.work(rt, p, concurrency=concurrency or DEFAULT_CONCURRENCY, until_idle=until_idle,
                               lease_seconds=lease_seconds, worker_id=worker_id, stop=stop_on_signals(),
                               observe=observe)
    emit(report.as_dict(), as_json, pairs)


def _serve_metrics(rt, p, host: str, port: int) -> WorkMetrics:
    """Serve /metrics for this process, its provider calls counted from now on."""
    metrics = WorkMetrics(p)
    rt.provider = metrics.wrap(rt.provider)
    bound_host, bound_port = metrics.serve(port, host)
    logging.getLogger(__name__).info("metrics on http://%s:%d/metrics", bound_host, bound_port)
    return metrics


@click.command()
@click.argument("directory")
@click.option("--concurrency", default=None, type=click.IntRange(1, 256))
@click.option("--allow-empty", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def embed(directory: str, concurrency: int | None, allow_empty: bool, as_json: bool) -> None:
    """Ingest DIRECTORY, then work until idle: the one-shot job."""
    rt = runtime(allow_empty=allow_empty)
    with pool() as p, work_progress(p) as bar:
        summary = embed_uc.embed_directory(rt, p, Path(directory),
                                           concurrency=concurrency or DEFAULT_CONCURRENCY,
                                           stop=stop_on_signals(), observe=bar.observe)
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
@click.option("--dry-run", is_flag=True, help="List what would be rerun; change nothing.")
@expected_errors
def rerun(stage: str, statuses: tuple[str, ...], error_class: str | None, stale: bool,
          before_version: str | None, documents: tuple[str, ...], dry_run: bool) -> None:
    """Re-run a stage for the documents a query selects (a partial rerun); the filters combine."""
    rt = runtime()
    with pool() as p:
        # Every target, a page at a time: each page is rerun before the next is read.
        pages = rerun_uc.pages(rt, p, stages_=(stage,), error_class=error_class, stale=stale,
                               statuses=statuses, before_version=before_version, documents=documents)
        if dry_run:
            listed = 0
            for page in pages:
                for t in page:
                    click.echo(f"{t.document_id} [{t.stage} {t.status} {t.error_class or '-'} {t.code_version}]")
                listed += len(page)
            click.echo(f"{listed} document(s) would be rerun")
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


COMMANDS = (migrate, ingest, work, embed, reconcile, rerun)
