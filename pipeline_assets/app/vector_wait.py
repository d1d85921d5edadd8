"""Waiting for some documents' vectors: enqueue what is missing, run a worker scoped to them here
(or leave them to the ``work`` processes), read their coverage until nothing of theirs is
outstanding, the worker stops, or the deadline; then build the model's index as a drain does.
Shared by the front ends of ``app.embed_selection`` (some documents, some buckets).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from psycopg_pool import ConnectionPool

from pipeline_assets.app import input_limits
from pipeline_assets.app.ingest import register_model
from pipeline_assets.app.runtime import Runtime
from pipeline_assets.app.scoped_worker import ScopedWorker
from pipeline_assets.jobqueue import running_ingests, transitions
from pipeline_assets.jobqueue.worker import FatalProviderError, WorkerReport
from pipeline_assets.registry import models, vector_index
from pipeline_assets.settings import Settings
from pipeline_assets.store import db, reports, stage_runs

log = logging.getLogger(__name__)

# How often a run embedding some documents probes the model's queue (two index
# probes: is anything waiting or leased?) while it waits for them. An idle
# queue means their chunks are ready or failed: the run reads their coverage
# at once instead of at the next full read.
WAIT_POLL_SECONDS = 0.1
# The full read of the documents' coverage (one grouped query over their
# chunks, seconds at 100,000 documents) comes at least this many times its
# last duration after the previous one: it decides when the queue is busy with
# other documents too, and costs the database a bounded share of its time.
WAIT_POLL_COST_FACTOR = 20
# Past this many documents a run's worker claims the model's whole queue
# instead of only the run's jobs: a scope that large is most of the queue, and
# the scoped claim's cost grows with it (a bucket backfill over everything).
SCOPE_MAX_DOCUMENTS = 2_000


class EmbedIncomplete(RuntimeError):
    """Some of the documents' chunks are neither ready nor failed; carries their counts."""

    def __init__(self, message: str, coverage: reports.Coverage) -> None:
        self.coverage = coverage
        self.outstanding = outstanding(coverage)
        super().__init__(message)


class EmbedDeadlineExceeded(EmbedIncomplete):
    """The documents' chunks were not all ready or failed by the deadline."""

    def __init__(self, coverage: reports.Coverage, deadline: float, in_process: bool) -> None:
        who = "the in-process worker and any `work` process" if in_process else "the external `work` processes"
        super().__init__(
            f"{outstanding(coverage)} of {coverage.wanted} chunk(s) still not embedded after "
            f"{deadline:g} s ({coverage.ready} ready, {coverage.failed} failed) waiting for {who}; "
            "see `pipeline-assets status`",
            coverage,
        )


class EmbedStopped(EmbedIncomplete):
    """The in-process worker stopped first (a token budget, a fault of our own); its one-line message."""


def outstanding(cov: reports.Coverage) -> int:
    """Chunks neither ready nor failed (waiting, leased, backing off, or without a job yet)."""
    return max(cov.wanted - cov.ready - cov.failed, 0)


D = TypeVar("D")


@dataclass
class Waited(Generic[D]):
    work: WorkerReport
    enqueued: int
    documents: int  # current documents waited for (len of current_pks())
    before: reports.Coverage
    after: reports.Coverage
    detail: D
    seconds: float
    index_put_off: str | None = None  # the line saying the model's index build was left for later


def wait_for_vectors(
    rt: Runtime,
    pool: ConnectionPool,
    current_pks: Callable[[], Sequence[int]],
    read: Callable[[], tuple[D, reports.Coverage]],
    *,
    many: bool,
    poll_seconds: float | None,
    in_process: bool,
    deadline_seconds: float | None,
) -> Waited[D]:
    """The wait both front ends share: enqueue what is missing for ``current_pks()``, run a
    worker here if ``in_process`` (scoped to them unless they are many), and ``read()`` their
    coverage until nothing of theirs is outstanding, the worker stops, or the deadline.
    ``many``: known to be more than SCOPE_MAX_DOCUMENTS before reading them."""
    deadline = deadline_seconds or rt.settings.embed_run_deadline
    # Before anything is enqueued or sent: the model's window is known and every chunk fits it.
    input_limits.check_input_limits(rt.settings, pool, rt.provider.spec)
    with pool.connection() as conn:
        register_model(conn, rt)
        since = stage_runs.clock(conn)
        busy = any(transitions.outstanding(conn, rt.model_id))
    started = time.monotonic()
    scoped = None
    if in_process and busy and many:
        # It claims the model's whole queue: it starts at once, while the documents are read
        # (tens of seconds at 100,000 of them); a scoped worker needs their keys first.
        scoped = ScopedWorker(rt, pool, None, poll_seconds)
    pks: Sequence[int] = ()
    try:
        pks = current_pks()
        with pool.connection() as conn:
            enqueued = transitions.enqueue_for_docs(conn, pks, rt.options.config.max_attempts)
        if scoped is None and in_process and (busy or enqueued):
            # Before the first coverage read (seconds at 100k documents): with nothing to claim
            # for the model, nothing of these documents waits either.
            scope = pks if len(pks) <= SCOPE_MAX_DOCUMENTS else None
            scoped = ScopedWorker(rt, pool, scope, poll_seconds)
        detail, before = read()
        now = before
        read_at, read_cost, idle_read = time.monotonic(), 0.0, False
        while outstanding(now) and (scoped is None or scoped.alive) and time.monotonic() - started < deadline:
            time.sleep(WAIT_POLL_SECONDS)
            with pool.connection() as conn:
                idle = not any(transitions.outstanding(conn, rt.model_id))
            due = time.monotonic() - read_at >= max(WAIT_POLL_SECONDS, WAIT_POLL_COST_FACTOR * read_cost)
            if due or (idle and not idle_read):
                read_at = time.monotonic()
                detail, now = read()
                read_cost = time.monotonic() - read_at
            idle_read = idle  # an idle queue triggers one read until it is busy again
    finally:
        report, error = scoped.finish() if scoped is not None else (WorkerReport(), None)
    with pool.connection() as conn:
        if scoped is not None:
            stage_runs.refresh_embed_touched(conn, rt.model_id, since)
        stage_runs.refresh_embed_docs(conn, rt.model_id, pks)
        idle = not any(transitions.outstanding(conn, rt.model_id))
    if outstanding(now):  # the worker stopped, or the deadline: the last word on them
        detail, now = read()
    after = now  # else the last read stands: nothing of theirs was left to change
    if isinstance(error, FatalProviderError):
        raise error
    if error is not None and outstanding(after):
        raise EmbedStopped(str(error), after) from error
    if error is not None:  # e.g. the budget was reached by the call that finished these documents
        log.warning("the worker stopped after these documents were done: %s", error)
    if outstanding(after):
        raise EmbedDeadlineExceeded(after, deadline, in_process)
    index_put_off = None
    if scoped is not None and idle:
        # the whole queue drained: as a worker does when it drains (and leaves)
        index_put_off = build_index_after_drain(pool, rt.model_id, rt.settings)
    return Waited(
        work=report,
        enqueued=enqueued,
        documents=len(pks),
        before=before,
        after=after,
        detail=detail,
        seconds=round(time.monotonic() - started, 3),
        index_put_off=index_put_off,
    )


def build_index_after_drain(pool: ConnectionPool, model_id: str, settings: Settings) -> str | None:
    """Build the model's vector index if it is missing (concurrently; a failure is only logged),
    unless an ingest is running (``running_ingests.index_build_decision``, a worker's rule when
    it drains): then the build is left for later and the returned line says so and who builds it."""
    with pool.connection() as conn:
        dimension = models.model_dimension(conn, model_id)
        if not dimension:
            return None
        if running_ingests.index_build_decision(lambda: running_ingests.any_running(conn)) == running_ingests.PUT_OFF:
            line = running_ingests.put_off_line(model_id)
            log.info("%s", line)
            return line
    try:
        with db.pool_connect(pool) as conn:
            vector_index.build(
                conn, model_id, int(dimension), memory_cap=settings.index_build_memory, session=settings.prepare
            )
    except vector_index.IndexNotOwned as exc:
        log.info("%s", exc)  # a role without DDL, or a transaction pooler: a session of the owner builds it
    except vector_index.IndexBuildError as exc:
        log.warning("%s", exc)
    return None
