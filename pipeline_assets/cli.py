"""The command line: parse, call a use case in ``pipeline_assets.app``, print.

Settings are read from the environment once, here, and passed down. Expected
failures print one line (``error: ...``) and exit 1; nothing here holds logic
the Dagster layer would need.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import click
import psycopg

from pipeline_assets.app import embed as embed_uc
from pipeline_assets.app import ingest as ingest_uc
from pipeline_assets.app import model_admin, reconcile as reconcile_uc, rerun as rerun_uc, search as search_uc
from pipeline_assets.app import status as status_uc
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.content.sources import SourceError
from pipeline_assets.jobs.worker import BudgetExhausted, FatalProviderError, WorkerFault
from pipeline_assets.providers import ConfigError, ProviderError
from pipeline_assets.settings import DEFAULT_CONCURRENCY, Settings, SettingsError, redact_text, reference_table
from pipeline_assets.store import db, embedded_postgres

# Expected database errors, besides a lost connection (OperationalError): InternalError
# covers a read-only server or transaction (ReadOnlySqlTransaction) and an index build
# pgvector refuses; InsufficientPrivilege a role that lacks a grant.
EXPECTED = (db.DatabaseUnavailable, SourceError, ConfigError, SettingsError, FatalProviderError, BudgetExhausted,
            WorkerFault,
            ProviderError, psycopg.OperationalError, psycopg.InternalError, psycopg.errors.InsufficientPrivilege,
            subprocess.TimeoutExpired, ValueError, OSError)


def expected_errors(fn):
    """Turn expected failures into one line on stderr and exit status 1."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except EXPECTED as exc:
            message = redact_text(" ".join(str(exc).split()) or type(exc).__name__)
            click.echo(f"error: {message}", err=True)
            sys.exit(1)
    return wrapper


def _settings() -> Settings:
    return click.get_current_context().find_root().obj


@contextmanager
def _pool(max_size: int = 4) -> Iterator:
    with db.open_pool(_settings(), max_size=max_size) as pool:
        yield pool


def _runtime(model: str | None = None) -> Runtime:
    return Runtime.build(_settings(), model)


def _emit(data, as_json: bool, text_lines) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        for line in text_lines(data):
            click.echo(line)


def _pairs(d: dict) -> list[str]:
    return [" ".join(f"{k}={v}" for k, v in d.items() if v is not None)]


def _stop_on_signals() -> threading.Event:
    """SIGTERM/SIGINT stop claiming; the worker hands back what it holds and exits."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    return stop


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log progress to stderr.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """Idempotent embedding pipeline: documents -> chunks -> embeddings in PostgreSQL."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ctx.obj = Settings.from_env()
    except SettingsError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


@main.command()
@expected_errors
def migrate() -> None:
    """Apply pending SQL migrations."""
    conn = db.connect(db.database_url(_settings()))
    applied = db.migrate(conn)
    click.echo(f"applied {len(applied)} migration(s)" + (f": {', '.join(applied)}" if applied else ""))


@main.command()
@click.argument("directory")
@click.option("--allow-empty", is_flag=True, help="Allow an empty source to tombstone all its documents.")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def ingest(directory: str, allow_empty: bool, as_json: bool) -> None:
    """Scan, checksum, extract, chunk and enqueue DIRECTORY. No provider calls."""
    rt = Runtime.build(_settings(), allow_empty=allow_empty)
    with _pool() as pool:
        report = ingest_uc.ingest_source(rt, pool, Path(directory))
    _emit(report.as_dict(), as_json, _pairs)


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
    with _pool() as pool:
        report = embed_uc.work(rt, pool, concurrency=concurrency or DEFAULT_CONCURRENCY, until_idle=until_idle,
                               lease_seconds=lease_seconds, worker_id=worker_id, stop=_stop_on_signals())
    _emit(report.as_dict(), as_json, _pairs)


@main.command()
@click.argument("directory")
@click.option("--concurrency", default=None, type=click.IntRange(1, 256))
@click.option("--allow-empty", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def embed(directory: str, concurrency: int | None, allow_empty: bool, as_json: bool) -> None:
    """Ingest DIRECTORY, then work until idle: the one-shot job."""
    rt = Runtime.build(_settings(), allow_empty=allow_empty)
    with _pool() as pool:
        summary = embed_uc.embed_directory(rt, pool, Path(directory),
                                           concurrency=concurrency or DEFAULT_CONCURRENCY,
                                           stop=_stop_on_signals())
    _emit(summary, as_json, _pairs)


@main.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--no-rescan", is_flag=True, help="Skip re-scanning sources; only repair the job table.")
@expected_errors
def reconcile(as_json: bool, no_rescan: bool) -> None:
    """Re-scan ingested sources and repair the job table to match."""
    rt = _runtime()
    with _pool() as pool:
        report = reconcile_uc.reconcile_all(rt, pool, rescan=not no_rescan)
    _emit(report.as_dict(), as_json, _pairs)


def _status_lines(d: dict):
    yield "documents: " + (" ".join(f"{k}={v}" for k, v in d["documents"].items()) or "none")
    yield "jobs: " + (" ".join(f"{k}={v}" for k, v in d["jobs"].items()) or "none")
    for stage, counts in d["stages"].items():
        yield f"stage {stage}: " + " ".join(f"{k}={v}" for k, v in counts.items())
    for model, c in d["coverage"].items():
        yield f"coverage {model}: {c['ready']}/{c['wanted']} ({c['ratio']:.1%})"
    for model, index in d.get("vector_index", {}).items():
        yield f"vector index {model}: {index}"
    yield f"dead letter: {d['dead_letter']} jobs, {d['quarantined_documents']} quarantined documents"
    yield f"superseded: {d['superseded']}"
    for model, s in d["spend"].items():
        yield (f"spend {model}: calls={s['calls']} tokens={s['tokens']} "
               f"duplicate_inputs={s.get('duplicate_inputs', 0)} extra_sends={s.get('extra_sends', 0)}")
    for model, b in d.get("breaker", {}).items():
        yield (f"breaker {model}: {b['state']} paused_for={b['paused_for']:.1f}s "
               f"failures_in_row={b['consecutive_failures']} probe_out={b['probe_out']}")
    yield f"retry-after cap: {d['retry_after_cap']:g}s (PIPELINE_RETRY_AFTER_CAP)"


@main.command()
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def status(as_json: bool) -> None:
    """Counts by job status and stage, coverage, dead letters, spend, the provider breaker."""
    with _pool() as pool:
        data = status_uc.status(pool)
    data["retry_after_cap"] = _settings().retry_after_cap
    _emit(data, as_json, _status_lines)


@main.group()
def dlq() -> None:
    """The dead-letter queue: failed jobs and quarantined documents."""


@dlq.command("list")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def dlq_list(as_json: bool) -> None:
    with _pool() as pool:
        items = status_uc.dead_letters(pool)

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
    with _pool() as pool:
        counts = status_uc.requeue(pool, job_ids, all_failed=all_)
    click.echo(f"requeued={counts['pending']} superseded={counts['superseded']}")


@main.command()
@click.option("--stage", type=click.Choice(rerun_uc.RERUN_STAGES), default="extract")
@click.option("--error-class", default=None, help="Only items that failed with this error class.")
@click.option("--stale", is_flag=True, help="Only items produced by another code version than the current one.")
@click.option("--dry-run", is_flag=True)
@expected_errors
def rerun(stage: str, error_class: str | None, stale: bool, dry_run: bool) -> None:
    """Re-run a stage for the documents a query selects (a partial rerun)."""
    rt = _runtime()
    with _pool() as pool:
        targets = rerun_uc.select(rt, pool, stages_=(stage,), error_class=error_class, stale=stale)
        if dry_run:
            for t in targets:
                click.echo(f"{t.document_id} [{t.status} {t.error_class or ''} {t.code_version}]")
            click.echo(f"{len(targets)} document(s) would be rerun")
            return
        total = rerun_uc.rerun(rt, pool, targets)
    click.echo(f"reran {stage} for {total} document(s)")


@main.command()
@click.option("--model", default=None, help="Model name as configured in PIPELINE_EMBEDDING_MODEL.")
@expected_errors
def export(model: str | None) -> None:
    """Current chunk embeddings as JSON Lines."""
    model_id = None if model else _runtime().model_id
    with _pool() as pool:
        model_id = model_id or model_admin.resolve(pool, model)
        out = sys.stdout
        try:
            for row in search_uc.export(pool, model_id):
                out.write(json.dumps(row, ensure_ascii=False))
                out.write("\n")
            out.flush()
        except BrokenPipeError:
            # The reader (head, a closed pipe) has had enough; that is not an error.
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
    with _pool() as pool:
        hits = search_uc.search(rt, pool, query, k)

    def lines(rows):
        for h in rows:
            snippet = " ".join(h["text"].split())[:100]
            yield f"{h['distance']:.4f} {h['document_id']}#{h['chunk_index']}: {snippet}"
    _emit(hits, as_json, lines)


@main.command("stop-db")
@expected_errors
def stop_db() -> None:
    """Stop the embedded PostgreSQL under PIPELINE_HOME (it otherwise outlives every command)."""
    settings = _settings()
    home = settings.home_path
    if settings.database_url:
        click.echo("PIPELINE_DATABASE_URL is set: no embedded server is managed here")
    elif embedded_postgres.stop_server(home):
        click.echo(f"stopped the embedded PostgreSQL in {home}")
    else:
        click.echo(f"no embedded PostgreSQL running in {home}")


@main.group("models")
def models_group() -> None:
    """Embedding models: list them, retire one after a model change, activate it again, build its index."""


@models_group.command("list")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def models_list(as_json: bool) -> None:
    """Models with their jobs and their vector index (exact search where there is none)."""
    with _pool() as pool:
        rows = model_admin.list_models(pool)
    _emit(rows, as_json, lambda rs: [f"{r['model_id']} name={r['name']} dim={r['dimension']} "
                                     f"active={r['active']} ready={r['ready']} outstanding={r['outstanding']} "
                                     f"index={r['index_detail']}"
                                     for r in rs])


@models_group.command("retire")
@click.argument("model")
@expected_errors
def models_retire(model: str) -> None:
    """Stop embedding new content with MODEL (its ready vectors are kept).

    Sticky: anything still configured with MODEL is refused until `models activate MODEL`."""
    with _pool() as pool:
        model_id, superseded = model_admin.retire(pool, model)
    click.echo(f"retired {model_id}: {superseded} unstarted job(s) superseded")


@models_group.command("activate")
@click.argument("model")
@expected_errors
def models_activate(model: str) -> None:
    """Use a retired MODEL again: its wanted content gets jobs (the next worker bills them)."""
    with _pool() as pool:
        r = model_admin.activate(pool, model, max_attempts=_settings().max_attempts)
    if not r["was_retired"]:
        click.echo(f"{r['model_id']} is already active")
    else:
        click.echo(f"activated {r['model_id']}: {r['revived']} job(s) revived, {r['enqueued']} enqueued")


@models_group.command("index")
@click.argument("model")
@expected_errors
def models_index(model: str) -> None:
    """Build MODEL's vector index now, concurrently (workers otherwise build it when their queue drains)."""
    with _pool() as pool:
        try:
            r = model_admin.build_index(pool, model)
        except model_admin.IndexBuildError as exc:
            click.echo(f"error: {redact_text(str(exc))}", err=True)
            sys.exit(1)
    click.echo(f"{r['model_id']}: index {r['detail']}")


@main.command("settings")
@click.option("--reference", is_flag=True, help="Print the reference table of every setting (Markdown).")
@click.option("--json", "as_json", is_flag=True)
def settings_cmd(reference: bool, as_json: bool) -> None:
    """The effective settings (secrets shown only as set/unset)."""
    if reference:
        click.echo(reference_table())
        return
    _emit(_settings().describe(), as_json, lambda d: [f"{k}={v}" for k, v in d.items()])


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=3000, show_default=True, type=click.IntRange(1, 65535))
def dev(host: str, port: int) -> None:
    """Start the Dagster UI and daemon on the embedded (or configured) database."""
    from pipeline_assets.defs.devserver import run_dev

    sys.exit(run_dev(_settings(), host=host, port=port))


@main.command("dagster-env")
def dagster_env() -> None:
    """Print the environment (export lines) that points Dagster's own commands at `dev`'s instance."""
    from pipeline_assets.defs.devserver import run_dagster_env

    sys.exit(run_dagster_env(_settings()))


if __name__ == "__main__":
    main()
