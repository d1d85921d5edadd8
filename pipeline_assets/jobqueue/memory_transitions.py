"""The state machine in memory: each transition of held jobs and the rescue of lost leases,
as the statements of jobs.sql do them for ``PostgresJobStore``.

The caller (``MemoryJobStore``) holds the queue's lock and has passed the fence (the jobs
given are held by the change's owner); each function returns what the jobs became.
"""

from __future__ import annotations

from pipeline_assets.jobqueue.changes import Change, Complete, Fail, GiveBack, Isolate, Retry, Supersede
from pipeline_assets.jobqueue.memory_queue import MemoryJob, MemoryQueue
from pipeline_assets.jobqueue.request_plan import FREE_FAULTS
from pipeline_assets.jobqueue.status import JobStatus

# The largest exponent of a backoff (as jobs.sql caps it).
MAX_DOUBLINGS = 30


def apply(q: MemoryQueue, change: Change, held: list[MemoryJob]) -> list[tuple[Change, dict[int, str]]]:
    """One change of held jobs (the fence already passed), as jobs.sql's statement of its kind."""
    now = q.now()
    if isinstance(change, Complete):
        vectors = dict(zip(change.job_ids, change.vectors, strict=True))
        ready: dict[int, str] = {j.job_id: JobStatus.READY for j in held if q.wanted(j)}
        for job in held:
            if job.job_id in ready:
                job.release(JobStatus.READY)
                job.error_class = job.error_message = None
                q.vectors[(job.chunk_checksum, job.model_id)] = vectors[job.job_id]
            else:
                job.release(JobStatus.SUPERSEDED)
        out: list[tuple[Change, dict[int, str]]] = [(change, ready)]
        if len(ready) < len(change.job_ids):
            lost: dict[int, str] = {j.job_id: JobStatus.SUPERSEDED for j in held if j.job_id not in ready}
            out.append((Supersede(tuple(i for i in change.job_ids if i not in ready)), lost))
        return out
    if isinstance(change, Isolate):  # marked once: an isolated job is not moved again
        fresh = [j for j in held if not j.isolate]
        for job in fresh:
            job.isolate = True
        return [(change, {j.job_id: j.status for j in fresh})]
    for job in held:
        retired = not q.active(job.model_id)
        if isinstance(change, Retry):
            delay = change.delays[change.job_ids.index(job.job_id)]
            job.release(
                JobStatus.SUPERSEDED
                if retired
                else JobStatus.FAILED
                if job.attempts >= job.max_attempts
                else JobStatus.RETRY
            )
            job.available_at, job.error_class, job.error_message = now + delay, change.error_class, change.message
        elif isinstance(change, GiveBack):
            job.release(
                JobStatus.SUPERSEDED if retired else JobStatus.PENDING if job.attempts <= 1 else JobStatus.RETRY
            )
            job.attempts = max(job.attempts - 1, 0)
            job.throttles += change.throttled
            job.faults += change.faulted
            job.available_at = now + change.delay
            job.error_class = change.error_class if change.error_class is not None else job.error_class
            job.error_message = change.message if change.message is not None else job.error_message
        elif isinstance(change, Fail):
            job.release(JobStatus.FAILED)
            job.error_class, job.error_message = change.error_class, change.message
        elif isinstance(change, Supersede):
            job.release(JobStatus.SUPERSEDED)
    return [(change, {j.job_id: j.status for j in held})]


def rescue(q: MemoryQueue, rescuer: str | None, *, base: float, cap: float) -> int:
    """Expired leases, and with ``rescuer`` the claims of dead workers, go back to be claimed
    again (jobs.sql rescue_expired); returns how many jobs were rescued."""
    now = q.now()
    judged = [
        (j, j.lease_expires_at is not None and j.lease_expires_at < now)
        for j in q.jobs.values()
        if j.status == JobStatus.PROCESSING
        and j.lease_owner is not None
        and ((j.lease_expires_at is not None and j.lease_expires_at < now) or q.dead(j.lease_owner, rescuer))
    ]
    per_process: dict[str, int] = {}
    for job, _ in judged:
        per_process[_process(job)] = per_process.get(_process(job), 0) + 1
    for job, expired in judged:
        charged = job.faults >= FREE_FAULTS and per_process[_process(job)] == 1
        retired = not q.active(job.model_id)
        job.release(
            JobStatus.SUPERSEDED
            if retired
            else JobStatus.FAILED
            if charged and job.attempts >= job.max_attempts
            else JobStatus.RETRY
            if charged or job.attempts > 1
            else JobStatus.PENDING
        )
        doublings = job.attempts if charged else job.faults + 1
        if not (charged or retired):
            job.attempts, job.faults = max(job.attempts - 1, 0), job.faults + 1
        job.available_at = now + q.rng.random() * min(cap, base * 2 ** min(doublings, MAX_DOUBLINGS))
        job.error_class = "lease_expired" if expired else "worker_dead"
        job.error_message = (
            "lease expired before completion (worker died or stalled)"
            if expired
            else "its worker process stopped beating (died) before completion"
        )
    return len(judged)


def _process(job: MemoryJob) -> str:
    """The worker process of a lease owner: the owner up to its last '/'."""
    owner = job.lease_owner or ""
    return owner[: owner.rfind("/") + 1]
