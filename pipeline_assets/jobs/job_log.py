"""The worker's job store, telling what happens to jobs: one log line per job
when a claim ends otherwise than ready (a retry, a dead letter, a give-back),
and a line per rescue; claims counted for the metrics.

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
from typing import Sequence

from pipeline_assets.jobs.job_store import JobStore
from pipeline_assets.jobs.transitions import ClaimedJob
from pipeline_assets.store import queries

log = logging.getLogger("pipeline_assets.jobs")

JOB_LOG = queries.load("job_log")

# How long a log line waits for a pooled connection to read its context; past it
# the line is written without document and attempt rather than holding up the worker.
CONTEXT_TIMEOUT_SECONDS = 2.0


class LoggedJobStore(JobStore):
    """A JobStore whose transitions of held jobs also log a line per job (same behaviour otherwise)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._count_lock = threading.Lock()
        self.claimed = 0  # jobs claimed by this store (read at scrape time by the metrics)

    def claim(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedJob]:
        jobs = super().claim(owner=owner, limit=limit, lease_seconds=lease_seconds)
        if jobs:
            with self._count_lock:
                self.claimed += len(jobs)
        return jobs

    def rescue(self, rescuer: str | None = None) -> int:
        n = super().rescue(rescuer)
        if n:
            log.warning("rescued %d job(s) whose lease expired or whose worker stopped beating", n,
                        extra={"worker_id": self.worker_id, "rescued": n})
        return n

    def give_back(self, *, owner: str, job_ids: Sequence[int], delay: float = 0.0,
                  error_class: str | None = None, message: str | None = None,
                  throttled: bool = False) -> list[int]:
        moved = super().give_back(owner=owner, job_ids=job_ids, delay=delay, error_class=error_class,
                                  message=message, throttled=throttled)
        # A fault of our own is worth a warning; throttles and shutdown hand-backs are routine.
        level = logging.WARNING if error_class and not throttled else logging.INFO
        why = "throttled" if throttled else (error_class or "not sent")
        # The give-back returned the attempt: the one it ended is the next one again.
        self._log_jobs(level, moved, "job given back without using an attempt (%s); available again in %.2f s",
                       (why, delay), error_class=error_class, attempt_offset=1)
        return moved

    def give_back_all(self, held: Sequence[tuple[str, list[int]]]) -> None:
        super().give_back_all(held)
        self._log_jobs(logging.INFO, [i for _, ids in held for i in ids],
                       "job handed back at shutdown without using an attempt", (), attempt_offset=1)

    def fail_retryable(self, *, owner: str, job_ids: Sequence[int], delays: Sequence[float], error_class: str,
                       message: str) -> dict[int, str]:
        moved = super().fail_retryable(owner=owner, job_ids=job_ids, delays=delays, error_class=error_class,
                                       message=message)
        retried = [i for i, s in moved.items() if s == "retry"]
        dead = [i for i, s in moved.items() if s == "failed"]
        self._log_jobs(logging.INFO, retried, "job failed (%s), will retry", (error_class,), error_class=error_class)
        self._log_jobs(logging.WARNING, dead, "job dead-lettered (%s): attempts used up", (error_class,),
                       error_class=error_class)
        return moved

    def fail_terminal(self, *, owner: str, job_ids: Sequence[int], error_class: str, message: str) -> list[int]:
        failed = super().fail_terminal(owner=owner, job_ids=job_ids, error_class=error_class, message=message)
        self._log_jobs(logging.WARNING, failed, "job dead-lettered (%s)", (error_class,), error_class=error_class)
        return failed

    # -- the lines -----------------------------------------------------------------------
    def _log_jobs(self, level: int, job_ids: Sequence[int], msg: str, args: tuple, *,
                  error_class: str | None = None, attempt_offset: int = 0) -> None:
        if not job_ids or not log.isEnabledFor(level):
            return
        try:
            context = self._context(job_ids)
        except Exception as exc:  # a log line must never fail a transition that already committed
            log.warning("could not read the context of %d job(s) to log: %s", len(job_ids), type(exc).__name__,
                        extra={"worker_id": self.worker_id})
            context = {}
        for job_id in job_ids:
            attempts, document_id = context.get(job_id, (None, None))
            log.log(level, msg, *args, extra={
                "job_id": job_id, "document_id": document_id, "worker_id": self.worker_id,
                "attempt": None if attempts is None else attempts + attempt_offset,
                "model_id": self.model_id, "error_class": error_class})

    def _context(self, job_ids: Sequence[int]) -> dict[int, tuple[int, str | None]]:
        with self.pool.connection(timeout=CONTEXT_TIMEOUT_SECONDS) as conn:
            rows = conn.execute(JOB_LOG.job_context, {"ids": list(job_ids)}).fetchall()
        return {job_id: (attempts, document_id) for job_id, attempts, document_id in rows}
