"""The command line: a thin layer over the core. Expected failures print one
line and exit non-zero; nothing here holds logic the Dagster layer would need."""

from __future__ import annotations

import functools
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import psycopg

from pipeline_assets.store import db
from pipeline_assets.jobs import models
from pipeline_assets.jobs import transitions
from pipeline_assets.app import reconcile as reconcile_mod
from pipeline_assets.app import reports
from pipeline_assets.app import retrieval
from pipeline_assets.app import stages
from pipeline_assets.app.ingest import ingest_directory, ingest_paths
from pipeline_assets.providers import ConfigError, ProviderError
from pipeline_assets.app.runtime import Runtime, runtime_from_env
from pipeline_assets.content.sources import SourceError
from pipeline_assets.jobs.worker import BudgetExhausted, FatalProviderError, Worker, WorkerConfig

EXPECTED = (db.DatabaseUnavailable, SourceError, ConfigError, FatalProviderError, BudgetExhausted, ProviderError,
            psycopg.OperationalError, subprocess.TimeoutExpired, ValueError, OSError)


def expected_errors(fn):
    """Turn expected failures into one line on stderr and exit status 1."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EXPECTED as exc:
            message = db.redact_text(" ".join(str(exc).split()) or type(exc).__name__)
            click.echo(f"error: {message}", err=True)
            sys.exit(1)
    return wrapper


def _runtime(model: str | None = None) -> Runtime:
    return runtime_from_env(model)


def _emit(data, as_json: bool, text_lines) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        for line in text_lines(data):
            click.echo(line)


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
def main(verbose: bool) -> None:
    """Idempotent embedding pipeline: documents -> chunks -> embeddings in PostgreSQL."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@expected_errors
def migrate() -> None:
    """Apply pending SQL migrations."""
    conn = db.connect()
    applied = db.migrate(conn)
    click.echo(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied else ""))


def _ingest(conn, directory: str, rt: Runtime, allow_empty: bool):
    fresh_model = models.ensure_model(conn, rt.provider.spec)
    rt.options.allow_empty = allow_empty
    report = ingest_directory(conn, Path(directory), rt.options)
    if fresh_model:
        # A model seen for the first time needs jobs for content ingested before it.
        report.enqueued += transitions.enqueue_missing(conn, rt.options.max_attempts)
    return report


@main.command()
@click.argument("directory")
@click.option("--allow-empty", is_flag=True, help="Allow an empty source to tombstone all its documents.")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def ingest(directory: str, allow_empty: bool, as_json: bool) -> None:
    """Scan, checksum, extract, chunk and enqueue DIRECTORY. No provider calls."""
    rt = _runtime()
    with db.session() as conn:
        report = _ingest(conn, directory, rt, allow_empty)
    _emit(report.as_dict(), as_json, lambda d: [" ".join(f"{k}={v}" for k, v in d.items())])


def _work(rt: Runtime, *, concurrency: int, until_idle: bool, lease_seconds: float | None,
          worker_id: str | None):
    url = db.database_url()
    with db.session(url):
        pass  # migrations applied before any thread starts
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    config = WorkerConfig(concurrency=concurrency, until_idle=until_idle, worker_id=worker_id)
    if lease_seconds:
        config.lease_seconds = lease_seconds
    worker = Worker(url, rt.provider, config, stop_event=stop)
    report = worker.run()
    with db.session(url) as conn:
        stages.refresh_embed(conn, rt.model_id)
    return report


@main.command()
@click.option("--concurrency", default=None, type=click.IntRange(1, 256), help="Requests in flight.")
@click.option("--until-idle", is_flag=True, help="Exit when no work is claimable, waiting or leased.")
@click.option("--lease-seconds", type=click.FloatRange(0.5, 3600), default=None)
@click.option("--worker-id", default=None)
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def work(concurrency: int | None, until_idle: bool, lease_seconds: float | None, worker_id: str | None,
         as_json: bool) -> None:
    """Claim and process embedding jobs (until SIGTERM, or --until-idle)."""
    rt = _runtime()
    report = _work(rt, concurrency=concurrency or WorkerConfig.concurrency, until_idle=until_idle,
                   lease_seconds=lease_seconds, worker_id=worker_id)
    _emit(report.as_dict(), as_json, lambda d: [" ".join(f"{k}={v}" for k, v in d.items() if v is not None)])


@main.command()
@click.argument("directory")
@click.option("--concurrency", default=None, type=click.IntRange(1, 256))
@click.option("--allow-empty", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def embed(directory: str, concurrency: int | None, allow_empty: bool, as_json: bool) -> None:
    """Ingest DIRECTORY, then work until idle: the one-shot job."""
    started = time.monotonic()
    rt = _runtime()
    with db.session() as conn:
        ing = _ingest(conn, directory, rt, allow_empty)
    work_report = _work(rt, concurrency=concurrency or WorkerConfig.concurrency, until_idle=True,
                        lease_seconds=None, worker_id=None)
    with db.session() as conn:
        st = reports.status(conn)
    cov = st["coverage"].get(rt.model_id, {"ready": 0, "wanted": 0})
    summary = {
        "model": rt.model_id,
        "documents": ing.scanned,
        "documents_changed": ing.new + ing.changed,
        "quarantined": ing.quarantined,
        "deleted": ing.deleted,
        "chunks": ing.chunks,
        "embedded": work_report.embedded,
        "reused": max(cov["ready"] - work_report.embedded, 0),
        "failed": st["jobs_by_model"].get(rt.model_id, {}).get("failed", 0),
        "provider_calls": work_report.provider_calls,
        "coverage": f"{cov['ready']}/{cov['wanted']}",
        "seconds": round(time.monotonic() - started, 2),
    }
    _emit(summary, as_json, lambda d: [" ".join(f"{k}={v}" for k, v in d.items())])


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-rescan", is_flag=True, help="Skip re-scanning sources; only repair the job table.")
@expected_errors
def reconcile(as_json: bool, no_rescan: bool) -> None:
    """Re-scan ingested sources and repair the job table to match."""
    rt = _runtime()
    with db.session() as conn:
        models.ensure_model(conn, rt.provider.spec)
        report = reconcile_mod.reconcile(conn, rt.options, model_id=rt.model_id, rescan=not no_rescan)
    _emit(report.as_dict(), as_json, lambda d: [" ".join(f"{k}={v}" for k, v in d.items())])


def _status_lines(d: dict):
    yield "documents: " + (" ".join(f"{k}={v}" for k, v in d["documents"].items()) or "none")
    yield "jobs: " + (" ".join(f"{k}={v}" for k, v in d["jobs"].items()) or "none")
    for stage, counts in d["stages"].items():
        yield f"stage {stage}: " + " ".join(f"{k}={v}" for k, v in counts.items())
    for model, c in d["coverage"].items():
        yield f"coverage {model}: {c['ready']}/{c['wanted']} ({c['ratio']:.1%})"
    yield f"dead letter: {d['dead_letter']} jobs, {d['quarantined_documents']} quarantined documents"
    yield f"superseded: {d['superseded']}"
    for model, s in d["spend"].items():
        yield (f"spend {model}: calls={s['calls']} tokens={s['tokens']} "
               f"duplicate_inputs={s.get('duplicate_inputs', 0)} extra_sends={s.get('extra_sends', 0)}")


@main.command()
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def status(as_json: bool) -> None:
    """Counts by job status and stage, coverage, dead letters, spend."""
    with db.session() as conn:
        for (model_id,) in conn.execute("SELECT model_id FROM app.models WHERE active"):
            stages.refresh_embed(conn, model_id)
        data = reports.status(conn)
    _emit(data, as_json, _status_lines)


@main.group()
def dlq() -> None:
    """The dead-letter queue: failed jobs and quarantined documents."""


@dlq.command("list")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def dlq_list(as_json: bool) -> None:
    with db.session() as conn:
        items = reports.dead_letters(conn)

    def lines(rows):
        if not rows:
            yield "dead-letter queue is empty"
        for r in rows:
            docs = ",".join(r["documents"][:3]) + ("…" if len(r["documents"]) > 3 else "")
            yield f"{r['kind']} {r['id']} [{r['error_class']}] {docs}: {r['message']}"
    _emit(items, as_json, lines)


@dlq.command("requeue")
@click.argument("job_ids", nargs=-1, type=int)
@click.option("--all", "all_", is_flag=True, help="Requeue every failed job.")
@expected_errors
def dlq_requeue(job_ids: tuple[int, ...], all_: bool) -> None:
    if not job_ids and not all_:
        raise click.UsageError("give job ids or --all")
    with db.session() as conn:
        counts = transitions.requeue_failed(conn, job_ids, all_failed=all_)
    click.echo(f"requeued={counts['pending']} superseded={counts['superseded']}")


@main.command()
@click.option("--stage", type=click.Choice(["extract", "chunk"]), default="extract")
@click.option("--error-class", default=None, help="Only items that failed with this error class.")
@click.option("--stale", is_flag=True, help="Only items produced by another code version than the current one.")
@click.option("--dry-run", is_flag=True)
@expected_errors
def rerun(stage: str, error_class: str | None, stale: bool, dry_run: bool) -> None:
    """Re-run a stage for the documents a query selects (a partial rerun)."""
    from pipeline_assets.content.extract import extractor_version

    rt = _runtime()
    current = extractor_version() if stage == "extract" else rt.options.chunker.version
    with db.session() as conn:
        targets = stages.rerun_targets(conn, stage=stage, error_class=error_class,
                                       not_version=current if stale else None)
        if dry_run:
            for t in targets:
                click.echo(f"{t.document_id} [{t.status} {t.error_class or ''} {t.code_version}]")
            click.echo(f"{len(targets)} document(s) would be rerun")
            return
        rt.options.force = True
        total = 0
        by_root: dict[str, list[str]] = {}
        for t in targets:
            by_root.setdefault(t.root, []).append(t.document_id)
        for root, ids in by_root.items():
            report = ingest_paths(conn, Path(root), ids, rt.options)
            total += report.scanned
        models.ensure_model(conn, rt.provider.spec)
    click.echo(f"reran {stage} for {total} document(s)")


def _model_id(conn, model: str | None, rt_model: str) -> str:
    if model is None:
        return rt_model
    resolved = models.resolve_model_id(conn, model)
    if resolved is None:
        raise ConfigError(f"unknown model {model!r}")
    return resolved


@main.command()
@click.option("--model", default=None, help="Model name as configured in PIPELINE_EMBEDDING_MODEL.")
@expected_errors
def export(model: str | None) -> None:
    """Current chunk embeddings as JSON Lines."""
    rt = _runtime(model) if model is None else None
    with db.session() as conn:
        model_id = _model_id(conn, model, rt.model_id if rt else "")
        out = sys.stdout
        try:
            for row in retrieval.export_rows(conn, model_id):
                out.write(json.dumps(row, ensure_ascii=False))
                out.write("\n")
            out.flush()
        except BrokenPipeError:
            # The reader (head, a closed pipe) has had enough; that is not an error.
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@main.command()
@click.argument("query")
@click.option("-k", default=5, type=click.IntRange(1, 1000))
@click.option("--model", default=None)
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def search(query: str, k: int, model: str | None, as_json: bool) -> None:
    """Nearest current chunks to QUERY by cosine distance."""
    rt = _runtime(model)
    vector = rt.provider.embed([query]).vectors[0]
    with db.session() as conn:
        hits = retrieval.search(conn, rt.model_id, vector, k)

    def lines(rows):
        for h in rows:
            snippet = " ".join(h["text"].split())[:100]
            yield f"{h['distance']:.4f} {h['document_id']}#{h['chunk_index']}: {snippet}"
    _emit(hits, as_json, lines)


@main.command("stop-db")
@expected_errors
def stop_db() -> None:
    """Stop the embedded PostgreSQL under PIPELINE_HOME (it otherwise outlives every command)."""
    from pipeline_assets.store import embedded_postgres
    from pipeline_assets import settings

    home = settings.pipeline_home()
    if settings.database_url_from_env():
        click.echo("PIPELINE_DATABASE_URL is set: no embedded server is managed here")
    elif embedded_postgres.stop_server(home):
        click.echo(f"stopped the embedded PostgreSQL in {home}")
    else:
        click.echo(f"no embedded PostgreSQL running in {home}")


@main.group("models")
def models_group() -> None:
    """Embedding models: list them, retire one after a model change."""


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def models_list(as_json: bool) -> None:
    with db.session() as conn:
        rows = models.list_models(conn)
    _emit(rows, as_json, lambda rs: [f"{r['model_id']} name={r['name']} dim={r['dimension']} "
                                     f"active={r['active']} ready={r['ready']} outstanding={r['outstanding']}"
                                     for r in rs])


@models_group.command("retire")
@click.argument("model")
@expected_errors
def models_retire(model: str) -> None:
    """Stop embedding new content with MODEL (its ready vectors are kept)."""
    with db.session() as conn:
        model_id = _model_id(conn, model, "")
        superseded = models.retire(conn, model_id)
    click.echo(f"retired {model_id}: {superseded} unstarted job(s) superseded")


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=3000, show_default=True, type=click.IntRange(1, 65535))
def dev(host: str, port: int) -> None:
    """Start the Dagster UI and daemon on the embedded (or configured) database."""
    from pipeline_assets.defs.devserver import run_dev

    sys.exit(run_dev(host=host, port=port))


if __name__ == "__main__":
    main()
