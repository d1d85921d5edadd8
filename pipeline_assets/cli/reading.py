"""Reading commands: status, search, export, settings."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import click
import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.app import input_limits, model_admin, model_runtime
from pipeline_assets.app import search as search_uc
from pipeline_assets.app import status as status_uc
from pipeline_assets.cli.common import emit, expected_errors, fail, pool, runtime, settings, stop_on_signals
from pipeline_assets.cli.progress import WATCH_SECONDS, watch_status
from pipeline_assets.messages import one_line
from pipeline_assets.settings import Settings
from pipeline_assets.settings_reference import reference_table
from pipeline_assets.store import db

EXPECTED_DB = (db.DatabaseUnavailable, psycopg.Error, OSError)


def _status_lines(d: dict) -> Iterator[str]:
    yield "documents: " + (" ".join(f"{k}={v}" for k, v in d["documents"].items()) or "none")
    for s in d.get("sources", []):
        yield (
            f"source {s['kind']} {s['source']}: current={s['current']} quarantined={s['quarantined']} "
            f"deleted={s['deleted']} last scan {s['last_scan_at'] or 'never'}"
        )
    if d.get("watched_source"):
        yield f"watched by the Dagster sensor: {d['watched_source']} (PIPELINE_SOURCE, else PIPELINE_SOURCE_DIR)"
    yield "jobs: " + (" ".join(f"{k}={v}" for k, v in d["jobs"].items()) or "none")
    yield f"backlog: {d.get('backlog', 0)} (pending + retry)"
    for stage, counts in d["stages"].items():
        yield f"stage {stage}: " + " ".join(f"{k}={v}" for k, v in counts.items())
    for model, c in d["coverage"].items():
        served = " served" if model == d.get("served_model") else ""
        yield f"coverage {model}: {c['ready']}/{c['wanted']} ({c['ratio']:.1%}){served}"
    for model, r in d.get("retired_models", {}).items():
        yield f"retired {model}: since {r['retired_at']}, " + (
            f"vectors deleted {r['purged_at']}" if r["purged_at"] else f"vectors deleted after {r['purge_after']}"
        )
    for model, index in d.get("vector_index", {}).items():
        yield f"vector index {model}: {index}"
    for m in d.get("input_limits", []):
        line = (
            f"input window {m['model_id']}: {m['max_input_tokens']} {m['tokenizer']} tokens, chunks up to "
            f"{m['max_chunk_tokens']} cl100k tokens (longest current: {m['longest_chunk_tokens'] or 0})"
        )
        problems = [f"{m['chunks_over_window']} current chunk(s) could exceed it"] if m["chunks_over_window"] else []
        if m["truncated_calls"]:
            problems.append(
                f"usage of {m['truncated_calls']} call(s) ({m['truncated_inputs']} input(s)) shows "
                "inputs truncated at the window"
            )
        if m["refused_too_long"]:
            problems.append(f"{m['refused_too_long']} input(s) refused as too long (dead letter input_too_long)")
        yield line + ("; WARNING: " + "; ".join(problems) if problems else "")
    yield f"dead letter: {d['dead_letter']} jobs, {d['quarantined_documents']} quarantined documents"
    yield f"superseded: {d['superseded']}"
    for model, s in d["spend"].items():
        yield (
            f"spend {model}: calls={s['calls']} tokens={s['tokens']} "
            f"duplicate_inputs={s.get('duplicate_inputs', 0)} extra_sends={s.get('extra_sends', 0)}"
        )
    for model, b in d.get("breaker", {}).items():
        yield (
            f"breaker {model}: {b['state']} paused_for={b['paused_for']:.1f}s "
            f"failures_in_row={b['consecutive_failures']} probe_out={b['probe_out']}"
        )
    yield f"retry-after cap: {d['retry_after_cap']:g}s (PIPELINE_RETRY_AFTER_CAP)"
    yield from _database_lines(d.get("database") or {})


def _database_lines(db_state: dict) -> Iterator[str]:
    """Whether workers can write; read-only: they wait (and say so in their log), charging nothing."""
    if db_state.get("read_only"):
        why = "a standby in recovery" if db_state.get("in_recovery") else "transaction_read_only = on"
        yield (
            f"database: READ-ONLY ({why}): workers cannot record progress; they wait and retry, "
            "charging no job, and resume when it is writable"
        )
    else:
        yield "database: writable"
    age = db_state.get("last_beat_seconds")
    yield (
        f"workers: {db_state.get('workers_beating', 0)} beating, {db_state.get('workers_silent', 0)} silent"
        + ("" if age is None else f" (newest beat {age:.0f}s ago)")
    )


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    is_flag=False,
    flag_value=WATCH_SECONDS,
    default=None,
    metavar="[SECONDS]",
    help=f"Refresh every SECONDS ({WATCH_SECONDS:g} if omitted) until Ctrl-C (--json: one JSON object per line).",
)
@click.option("--count", type=click.IntRange(min=1), default=None, help="With --watch: stop after N refreshes.")
@expected_errors
def status(as_json: bool, watch: float | None, count: int | None) -> None:
    """Counts by job status and stage, coverage, dead letters, spend, the provider breaker."""
    with pool() as p:
        if watch is not None:
            return watch_status(
                lambda: _status_data(p), _status_lines, as_json, watch, count, stop_event=stop_on_signals()
            )
        data = _status_data(p)
    emit(data, as_json, _status_lines)


def _status_data(p: ConnectionPool) -> dict:
    return status_uc.status(p, settings()).as_dict()


@click.command()
@click.option("--model", default=None, help="Model name as configured in PIPELINE_EMBEDDING_MODEL.")
@expected_errors
def export(model: str | None) -> None:
    """Current chunk embeddings as JSON Lines."""
    with pool() as p:
        # Without --model: the served model (`models serve`); the configured one before any is registered.
        model_id = model_admin.resolve(p, model) if model else (model_admin.served_model_id(p) or runtime().model_id)
        out = sys.stdout
        try:
            for row in search_uc.export(p, model_id):
                out.write(json.dumps(row, ensure_ascii=False))
                out.write("\n")
            out.flush()
        except BrokenPipeError:
            # The reader (head, a closed pipe) has had enough; that is not an error.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@click.command()
@click.argument("query")
@click.option("-k", default=5, type=click.IntRange(1, 1000))
@click.option("--model", default=None)
@click.option(
    "--mode",
    type=click.Choice(search_uc.MODES),
    default=search_uc.MODES[0],
    show_default=True,
    help="hybrid: full-text and vector rankings fused; vector: cosine distance; text: full-text only.",
)
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def search(query: str, k: int, model: str | None, mode: str, as_json: bool) -> None:
    """Best current chunks for QUERY: full-text search and vector similarity fused (hybrid), or either alone."""
    with pool() as p:
        # Without --model: the served model (`models serve`), whatever is configured.
        rt = runtime(model) if model else model_runtime.served_runtime(settings(), p)
        hits = search_uc.search(rt, p, query, k, mode)

    def lines(rows: list[dict]) -> Iterator[str]:
        for h in rows:
            snippet = one_line(h["text"])[:100]
            distance = "-" if h["distance"] is None else f"{h['distance']:.4f}"
            yield f"{h['score']:.4f} {distance} {h['document_id']}#{h['chunk_index']}: {snippet}"

    emit(hits, as_json, lines)


@click.command("settings")
@click.option("--reference", is_flag=True, help="Print the reference table of every setting (Markdown).")
@click.option("--json", "as_json", is_flag=True)
def settings_cmd(reference: bool, as_json: bool) -> None:
    """The effective settings (secrets shown only as set/unset), and PIPELINE_CHUNK_TOKENS checked
    against the input window of the configured model and of every active one (exit 1 if one is too small).

    Active models are read when a database is set (PIPELINE_DATABASE_URL) or the embedded one exists."""
    if reference:
        click.echo(reference_table())
        return
    s = settings()
    report = _limit_report(s)
    # The chunk size and overlap in force: when unset, fitted to the configured model's window.
    shown = {
        **s.describe(),
        "PIPELINE_CHUNK_TOKENS": report["chunk_tokens"],
        "PIPELINE_CHUNK_OVERLAP": report["chunk_overlap"],
    }
    if as_json:
        emit({**shown, "input_limits": report}, True, None)
    else:
        emit(shown, False, lambda d: [f"{k}={v}" for k, v in d.items()])
        for m in report["models"]:
            click.echo(
                f"input window {m['model_id']} ({m['role']}): {m['max_input_tokens']} {m['tokenizer']} "
                f"tokens, chunks up to {m['max_chunk_tokens']} cl100k tokens: "
                + ("fits" if m["fits"] else f"PIPELINE_CHUNK_TOKENS={report['chunk_tokens']} does not fit")
            )
        for warning in report["warnings"]:
            click.echo(f"warning: {warning}")
    if report["error"]:
        fail(report["error"])


def _limit_report(s: Settings) -> dict:
    """The configured model's window always; the active models' when a database is there to read."""
    if not (s.database_url or (s.home_path / "pgdata").exists()):
        return input_limits.input_limit_report(s)
    try:
        with pool() as p:
            return input_limits.input_limit_report(s, p)
    except EXPECTED_DB as exc:
        report = input_limits.input_limit_report(s)
        report["warnings"].append(f"active models not checked: {one_line(exc)[:200]}")
        return report


COMMANDS = (status, search, export, settings_cmd)
