"""`dlq`: the dead-letter queue as a work list: failed jobs and quarantined documents."""

from __future__ import annotations

import getpass
import re
from collections.abc import Iterator
from typing import Any

import click

from pipeline_assets.app import dlq as dlq_uc
from pipeline_assets.cli.common import emit, expected_errors, pool, runtime, settings
from pipeline_assets.providers import register_secret

# History outcomes caused by a person (requeue, discard), not by a worker.
PERSON_OUTCOMES = ("requeued", "discarded")
_FRACTION = re.compile(r"\.\d+")


def _t(iso: str | None) -> str:
    """A timestamp for people: to the second."""
    return _FRACTION.sub("", iso) if iso else "-"


def _user() -> str:
    """Who acts, when --by is not given: the OS user."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


@click.group()
def dlq() -> None:
    """The dead-letter queue: failed jobs and quarantined documents."""


@dlq.command("list")
@click.option("--error-class", "error_class", help="List the items of this error class.")
@click.option("--items", "all_items", is_flag=True, help="List every item instead of the groups.")
@click.option("--discarded", is_flag=True, help="List the discarded items instead (who gave up, and why).")
@click.option("--groups", "as_groups", is_flag=True, help="With --json: the groups instead of the items.")
@click.option("--json", "as_json", is_flag=True, help="The items as JSON (the groups with --groups).")
@expected_errors
def dlq_list(error_class: str | None, all_items: bool, discarded: bool, as_groups: bool, as_json: bool) -> None:
    """Groups by error class (count, first and last seen); the items with --error-class C."""
    grouped = as_groups or not (as_json or error_class or all_items or discarded)
    with pool() as p:
        data = dlq_uc.groups(p) if grouped else dlq_uc.items(p, error_class=error_class, discarded=discarded)
    emit(data, as_json, _group_lines if grouped else _item_lines)


def _group_lines(rows: list[dict[str, Any]]) -> Iterator[str]:
    open_rows = [r for r in rows if r["items"]]
    if not open_rows:
        yield "dead-letter queue is empty"
    else:
        yield f"{'kind':<8} {'error class':<22} {'items':>6}  first seen / last seen"
    for r in open_rows:
        yield (
            f"{r['kind']:<8} {r['error_class'] or '-':<22} {r['items']:>6}  "
            f"first {_t(r['first_seen'])}  last {_t(r['last_seen'])}"
        )
    discarded = sum(r["discarded"] for r in rows)
    if discarded:
        yield f"discarded: {discarded} (dlq list --discarded)"
    if open_rows:
        yield "items of a class: dlq list --error-class C; one item: dlq show ID"


def _item_lines(rows: list[dict[str, Any]]) -> Iterator[str]:
    if not rows:
        yield "no items"
    for r in rows:
        docs = ",".join(r["documents"][:3]) + ("…" if len(r["documents"]) > 3 else "")
        line = f"{r['kind']} {r['id']} [{r['error_class']}] {_t(r['failed_at'])} {docs}: {r['message']}"
        if r["discarded"]:
            line += f" (discarded by {r['discarded']['by']}: {r['discarded']['reason']})"
        yield line


@dlq.command("show")
@click.argument("item_id")
@click.option("--json", "as_json", is_flag=True)
@expected_errors
def dlq_show(item_id: str, as_json: bool) -> None:
    """One item: a job with every recorded attempt, or a document with its stages."""
    with pool() as p:
        data = dlq_uc.show(p, item_id)
    emit(data, as_json, _show_lines)


def _show_lines(d: dict[str, Any]) -> Iterator[str]:
    if d["kind"] == "job":
        yield (
            f"job {d['id']} model={d['model']} status={d['status']} attempts={d['attempts']}/"
            f"{d['max_attempts']} throttles={d['throttles']} error_class={d['error_class']}"
        )
        yield f"documents: {', '.join(d['documents']) or '-'}"
        if d["discarded"]:
            yield f"discarded by {d['discarded']['by']} at {_t(d['discarded']['at'])}: {d['discarded']['reason']}"
        yield f"history (newest {d['history_kept']} kept):"
        for a in d["history"]:
            who = "by" if a["outcome"] in PERSON_OUTCOMES else "worker"
            yield (
                f"  {_t(a['at'])}  attempt {a['attempt']}  {a['outcome']:<10} -> {a['status']:<10} "
                f"{who}={a['worker'] or '-'}  [{a['error_class'] or '-'}] {a['message'] or ''}"
            )
        return
    for s in d["sources"]:
        yield f"document {d['id']} in {s['source']}: {s['status']} [{s['error_class'] or '-'}] {s['message'] or ''}"
        if s["discarded"]:
            yield f"discarded by {s['discarded']['by']} at {_t(s['discarded']['at'])}: {s['discarded']['reason']}"
        for st in s["stages"]:
            model = f" ({st['model_id']})" if st["model_id"] else ""
            yield (
                f"  {st['stage']}{model}: {st['status']} attempts={st['attempts']} "
                f"version={st['code_version']} [{st['error_class'] or '-'}] {st['last_error'] or ''}"
            )


@dlq.command("requeue")
@click.argument("item_ids", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Requeue every failed job not discarded.")
@click.option(
    "--error-class",
    "error_class",
    help="Requeue every item of this class not discarded (jobs; documents are re-extracted).",
)
@click.option("--by", help="Who requeues (recorded in the history); default: the OS user.")
@expected_errors
def dlq_requeue(item_ids: tuple[str, ...], all_: bool, error_class: str | None, by: str | None) -> None:
    """Send dead letters back: job ids (numbers) or document ids (paths; doc:PATH for a numeric one)."""
    if not item_ids and not all_ and not error_class:
        raise click.UsageError("give item ids, --all or --error-class")
    with pool() as p:
        counts = dlq_uc.requeue(
            p, runtime, ids=dlq_uc.Ids.parse(item_ids), all_jobs=all_, error_class=error_class, by=by or _user()
        )
    click.echo(" ".join(f"{k}={v}" for k, v in counts.items()))


@dlq.command("discard")
@click.argument("item_ids", nargs=-1, required=True)
@click.option("--reason", required=True, help="Why this is given up on (stored, sanitized).")
@click.option("--by", help="Who gives up; default: the OS user.")
@expected_errors
def dlq_discard(item_ids: tuple[str, ...], reason: str, by: str | None) -> None:
    """Give up on dead letters: they leave the work list, requeue --all and the growth check."""
    register_secret(settings().openai_api_key or "")  # the reason is stored: never with the key in it
    with pool() as p:
        counts = dlq_uc.discard(p, item_ids, reason=reason, by=by or _user())
    click.echo(f"discarded jobs={counts['jobs']} documents={counts['documents']}")


COMMANDS = (dlq,)
