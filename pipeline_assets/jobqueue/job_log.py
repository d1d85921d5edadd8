"""Observers of the job queue (``changes.JobObserver``): a log line per job
when a claim ends otherwise than ready (a retry, a dead letter, a give-back),
a line per rescue (``JobLog``), and the claims counted for the metrics
(``ClaimCounter``). They watch what ``JobStore.apply`` applied; the store
knows nothing of them.

Every line about a job carries ``job_id``, ``document_id`` (one document that
carries its content; None once none does), ``attempt`` and ``worker_id`` as
``extra`` fields, which the CLI's log formatter writes as JSON fields or
``key=value``. Never the chunk text. The context is read from the database
(``sql/queries/job_log.sql``) only when the line is going to be written, so
the success path (claim, complete) costs one counter under a lock per claim.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from psycopg_pool import ConnectionPool

from pipeline_assets.jobqueue.changes import Change, ClaimedJob, Fail, GiveBack, JobObserver, Retry
from pipeline_assets.jobqueue.decisions import WORKER_ERROR
from pipeline_assets.jobqueue.status import JobStatus
from pipeline_assets.store import queries

log = logging.getLogger("pipeline_assets.jobqueue")

JOB_LOG = queries.load("job_log")

# How long a log line waits for a pooled connection to read its context; past it
# the line is written without document and attempt rather than holding up the worker.
CONTEXT_TIMEOUT_SECONDS = 2.0


class ClaimCounter(JobObserver):
    """Jobs claimed (read at scrape time by the metrics as ``JobStore.claimed``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.claimed_jobs = 0

    def claimed(self, jobs: Sequence[ClaimedJob]) -> None:
        with self._lock:
            self.claimed_jobs += len(jobs)


class JobLog(JobObserver):
    """A log line per job whose claim ended otherwise than ready, and per rescue."""

    def __init__(self, pool: ConnectionPool, *, worker_id: str, model_id: str) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.model_id = model_id

    def rescued(self, count: int) -> None:
        log.warning(
            "rescued %d job(s) whose lease expired or whose worker stopped beating",
            count,
            extra={"worker_id": self.worker_id, "rescued": count},
        )

    def applied(self, change: Change, became: dict[int, str]) -> None:
        moved = list(became)
        if isinstance(change, GiveBack):
            self._given_back(change, moved)
        elif isinstance(change, Retry):
            retried = [i for i, s in became.items() if s == JobStatus.RETRY]
            dead = [i for i, s in became.items() if s == JobStatus.FAILED]
            self._log_jobs(
                logging.INFO,
                retried,
                "job failed (%s), will retry",
                (change.error_class,),
                error_class=change.error_class,
            )
            self._log_jobs(
                logging.WARNING,
                dead,
                "job dead-lettered (%s): attempts used up",
                (change.error_class,),
                error_class=change.error_class,
            )
        elif isinstance(change, Fail):
            self._log_jobs(
                logging.WARNING, moved, "job dead-lettered (%s)", (change.error_class,), error_class=change.error_class
            )

    def _given_back(self, change: GiveBack, moved: list[int]) -> None:
        # The give-back returned the attempt: the one it ended is the next one again.
        if change.faulted:
            self._log_jobs(
                logging.INFO,
                moved,
                "job's request failed (%s: charged to the provider and the "
                "request, no attempt used), will retry in %.2f s",
                (change.error_class, change.delay),
                error_class=change.error_class,
                attempt_offset=1,
            )
            return
        if change.error_class is None:
            self._log_jobs(
                logging.INFO, moved, "job handed back without using an attempt (not sent)", (), attempt_offset=1
            )
            return
        # A fault of our own is worth a warning; throttles and the provider's unusable answers are
        # routine (the breaker counts them; a few unmatchable ones in a row stop the worker with a line).
        level = logging.WARNING if change.error_class == WORKER_ERROR else logging.INFO
        why = "throttled" if change.throttled else change.error_class
        self._log_jobs(
            level,
            moved,
            "job given back without using an attempt (%s); available again in %.2f s",
            (why, change.delay),
            error_class=change.error_class,
            attempt_offset=1,
        )

    # -- the lines -----------------------------------------------------------------------
    def _log_jobs(
        self,
        level: int,
        job_ids: Sequence[int],
        msg: str,
        args: tuple,
        *,
        error_class: str | None = None,
        attempt_offset: int = 0,
    ) -> None:
        if not job_ids or not log.isEnabledFor(level):
            return
        try:
            context = self._context(job_ids)
        except Exception as exc:  # a log line must never fail a transition that already committed
            log.warning(
                "could not read the context of %d job(s) to log: %s",
                len(job_ids),
                type(exc).__name__,
                extra={"worker_id": self.worker_id},
            )
            context = {}
        for job_id in job_ids:
            attempts, document_id = context.get(job_id, (None, None))
            log.log(
                level,
                msg,
                *args,
                extra={
                    "job_id": job_id,
                    "document_id": document_id,
                    "worker_id": self.worker_id,
                    "attempt": None if attempts is None else attempts + attempt_offset,
                    "model_id": self.model_id,
                    "error_class": error_class,
                },
            )

    def _context(self, job_ids: Sequence[int]) -> dict[int, tuple[int, str | None]]:
        with self.pool.connection(timeout=CONTEXT_TIMEOUT_SECONDS) as conn:
            rows = conn.execute(JOB_LOG.job_context, {"ids": list(job_ids)}).fetchall()
        return {job_id: (attempts, document_id) for job_id, attempts, document_id in rows}


def observers(
    pool: ConnectionPool, *, worker_id: str, model_id: str, extra: Sequence[JobObserver] = ()
) -> list[JobObserver]:
    """The observers a worker's store is built with."""
    return [JobLog(pool, worker_id=worker_id, model_id=model_id), ClaimCounter(), *extra]


__all__: list[str] = ["ClaimCounter", "JobLog", "observers"]
