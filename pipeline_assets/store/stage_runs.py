"""Per-item stage state (app.stage_runs) and the partial-rerun query.

extract and chunk rows are written by ingest as it runs (model_id ''). The embed
row of a document is per model, derived from its jobs for that model
(``embed_state`` in sql/queries/stage_runs.sql) and stored set-based (one
statement, no loop over rows): at the end of a work run for the documents the
run touched, after ``embed_and_wait`` for its documents, and by reconcile for
every current document. ``status`` never stores it: ``embed_counts`` computes
the same derivation in its read query.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg import sql
from psycopg.rows import class_row

from pipeline_assets.messages import one_line
from pipeline_assets.store import arrays, queries
from pipeline_assets.store.background import BackgroundWork

log = logging.getLogger(__name__)

STAGE_RUNS = queries.load("stage_runs")


@dataclass(frozen=True)
class RerunTarget:
    root: str
    document_id: str
    stage: str
    status: str
    error_class: str | None
    code_version: str | None


def _state(models: str, scope: str) -> sql.Composed:
    return sql.SQL(STAGE_RUNS.embed_state).format(models=sql.SQL(models), scope=sql.SQL(scope))


def _refresh(scope: str) -> sql.Composed:
    return sql.SQL(STAGE_RUNS.refresh_embed).format(state=_state(STAGE_RUNS.embed_models_one, scope))


def clock(conn: psycopg.Connection) -> datetime:
    """The database's now(): take it before a work run and pass it to ``refresh_embed_touched``."""
    return queries.scalar(conn, STAGE_RUNS.clock)


def refresh_embed(conn: psycopg.Connection, model_id: str) -> int:
    """Store the embed row of every current document for a model (reconcile). Returns rows written."""
    return conn.execute(_refresh(STAGE_RUNS.embed_scope_all), {"model": model_id}).rowcount


def refresh_embed_docs(conn: psycopg.Connection, model_id: str, doc_pks: Sequence[int]) -> int:
    """Store the embed rows of some documents for a model."""
    if not doc_pks:
        return 0
    docs = arrays.int8(conn, doc_pks)  # one binary bigint[], as transitions.enqueue_for_docs sends them
    return conn.execute(_refresh(STAGE_RUNS.embed_scope_docs), {"model": model_id, "docs": docs}).rowcount


def refresh_embed_touched(conn: psycopg.Connection, model_id: str, since: datetime) -> int:
    """Store the embed rows of the documents a work run touched: whose content got
    its vector or failed since ``since`` (the database clock before the run), and
    those whose stored row says failed."""
    return conn.execute(_refresh(STAGE_RUNS.embed_scope_touched), {"model": model_id, "since": since}).rowcount


def refresh_embed_drained(conn: psycopg.Connection, model_id: str, since: datetime) -> datetime | None:
    """``refresh_embed_touched`` when a worker's queue drains, proving what it covers: the database
    clock ``until`` when no job of the model was outstanding in its snapshot (a later
    ``refresh_embed_touched(since=until)`` then adds everything it could not see), else None."""
    query = sql.SQL(STAGE_RUNS.refresh_embed_drained).format(refresh=_refresh(STAGE_RUNS.embed_scope_touched))
    row = conn.execute(query, {"model": model_id, "since": since}).fetchone()
    assert row is not None  # an aggregate: always one row
    until, outstanding, _written = row
    return None if outstanding else until


class BackgroundStages(BackgroundWork):
    """``refresh_embed_drained`` beside a worker's index build, on a connection of its own; ``until``
    is what it returned (None until then, or if it failed: the run's end refreshes from ``since``)."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection],
        model_id: str,
        since: datetime,
        *,
        on_done: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(connect, name="embed-stages", on_done=on_done)
        self.model_id = model_id
        self.since = since
        self.until: datetime | None = None

    def work(self, conn: psycopg.Connection) -> None:
        self.until = refresh_embed_drained(conn, self.model_id, self.since)

    def failed(self, exc: Exception) -> None:
        if not self.stopped.is_set():
            log.warning(
                "could not record the embed stage at the drain (the end of the run records it): %s",
                one_line(exc),
            )


def embed_counts(conn: psycopg.Connection) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """The embed stage of current documents, read-only: (documents by status over every
    active model, {model: documents by status})."""
    query = sql.SQL(STAGE_RUNS.embed_counts).format(
        state=_state(STAGE_RUNS.embed_models_active, STAGE_RUNS.embed_scope_all)
    )
    overall: dict[str, int] = {}
    by_model: dict[str, dict[str, int]] = {}
    for model_id, status, n in conn.execute(query).fetchall():
        if model_id is None:
            overall[status] = n
        else:
            by_model.setdefault(model_id, {})[status] = n
    return overall, by_model


def glob_to_like(pattern: str) -> str:
    """A document-id glob (``*`` any run of characters, ``/`` included; ``?`` one character) as a LIKE pattern."""
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%").replace("?", "_")


def rerun_targets(
    conn: psycopg.Connection,
    *,
    stage: str,
    error_class: str | None = None,
    not_version: str | None = None,
    versions_by_extension: Mapping[str, str] | None = None,
    statuses: Sequence[str] | None = None,
    before_version: str | None = None,
    documents: Sequence[str] | None = None,
    failed_only: bool = False,
    model_id: str | None = None,
    root: str | None = None,
    buckets: Sequence[int] | None = None,
    n: int = 0,
    after: str = "",
    limit: int = 1_000_000,
) -> list[RerunTarget]:
    """The rows ``rerun_targets`` selects (see sql/queries/stage_runs.sql); every filter is optional.

    ``not_version``: produced by another version than this one, or, for a document whose
    extension is in ``versions_by_extension``, than that extension's. ``documents``: globs.
    For embed, one target per (document, model) unless ``model_id`` picks one model.
    ``root``: one source; ``buckets``: only its documents in these buckets (of ``n``);
    ``after``/``limit``: one page, the first ``limit`` rows past that document id."""
    exts = dict(versions_by_extension or {})
    with conn.cursor(row_factory=class_row(RerunTarget)) as cur:
        return cur.execute(
            STAGE_RUNS.rerun_targets,
            {
                "stage": stage,
                "error_class": error_class,
                "not_version": not_version,
                "ext_keys": list(exts),
                "ext_versions": list(exts.values()),
                "statuses": list(statuses) if statuses else None,
                "before_version": before_version,
                "documents": [glob_to_like(g) for g in documents] if documents else None,
                "failed_only": failed_only,
                "model": model_id,
                "root": root,
                "after": after,
                "n": n,
                "buckets": sorted(set(buckets)) if buckets is not None else None,
                "limit": limit,
            },
        ).fetchall()


def failed_jobs_of(conn: psycopg.Connection, root: str, document_ids: Sequence[str], model_id: str) -> list[int]:
    """The failed jobs of a model for the current chunks of some documents of a source."""
    rows = conn.execute(STAGE_RUNS.rerun_failed_jobs, {"root": root, "ids": list(document_ids), "model": model_id})
    return [r[0] for r in rows]


def current_document_pks(conn: psycopg.Connection, root: str, document_ids: Sequence[str]) -> list[int]:
    return [r[0] for r in conn.execute(STAGE_RUNS.rerun_document_pks, {"root": root, "ids": list(document_ids)})]
