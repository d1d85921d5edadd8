"""The pipeline's own commands: ingest, work, embed, reconcile."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import click

from pipeline_assets.app import embed as embed_uc
from pipeline_assets.app import ingest as ingest_uc
from pipeline_assets.app import reconcile as reconcile_uc
from pipeline_assets.app.source_registry import open_source
from pipeline_assets.cli.common import emit, expected_errors, pairs, pool, runtime, settings, stop_on_signals
from pipeline_assets.cli.progress import work_progress
from pipeline_assets.jobqueue.worker_config import DEFAULT_CONCURRENCY

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from pipeline_assets.app.metrics import WorkMetrics
    from pipeline_assets.app.runtime import Runtime
    from pipeline_assets.jobqueue.worker import Worker


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
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (/metrics) while working.",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address the metrics server binds.")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def work(
    concurrency: int | None,
    until_idle: bool,
    lease_seconds: float | None,
    worker_id: str | None,
    metrics_port: int | None,
    metrics_host: str,
    as_json: bool,
) -> None:
    """Claim and process embedding jobs (until SIGTERM, or --until-idle)."""
    stop_event = stop_on_signals()  # first: a stop during the start-up is a stop, not lost
    rt = runtime()
    with pool() as p, work_progress(p, enabled=None if until_idle else False) as bar:
        metrics = None if metrics_port is None else _serve_metrics(rt, p, metrics_host, metrics_port)

        def observe(worker: Worker) -> None:  # the worker, once built: its counters are read, nothing is pushed
            bar.observe(worker)
            if metrics is not None:
                metrics.observe(worker)

        report = embed_uc.work(
            rt,
            p,
            concurrency=concurrency or DEFAULT_CONCURRENCY,
            until_idle=until_idle,
            lease_seconds=lease_seconds,
            worker_id=worker_id,
            stop_event=stop_event,
            observe=observe,
        )
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
    stop_event = stop_on_signals()  # first: a stop during the start-up is a stop, not lost
    rt = runtime(allow_empty=allow_empty)
    src = open_source(source, settings().source_config())
    with pool() as p, work_progress(p) as bar:
        summary = embed_uc.embed_directory(
            rt,
            p,
            src,
            concurrency=concurrency or DEFAULT_CONCURRENCY,
            stop_event=stop_event,
            observe=bar.observe,
        )
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


COMMANDS = (ingest, work, embed, reconcile)
