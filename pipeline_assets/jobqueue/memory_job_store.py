"""``JobStore`` in memory, over a ``MemoryQueue``: the same contract as
``PostgresJobStore`` (the contract suite runs both), without a database.

Each method is atomic under the queue's lock, as each PostgreSQL statement (or
short transaction) is; every transition of a held job is fenced by its lease
owner (the transitions themselves: ``jobqueue.memory_transitions``). Time is the
queue's clock: leases expire and pauses end when it passes. For unit tests of
the worker and the executor; never a production queue. Its ledger has no day
boundary: ``tokens_today_of_others`` counts every call.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline_assets.jobqueue import ledger, memory_transitions
from pipeline_assets.jobqueue.breaker_config import BREAKER_PROBE_INTERVAL, BREAKER_THRESHOLD
from pipeline_assets.jobqueue.changes import Change, ClaimedJob, GiveBack, JobObserver, merged
from pipeline_assets.jobqueue.job_store import Answer, failure_billing, tell
from pipeline_assets.jobqueue.memory_queue import CRASH_ERRORS, NEVER, Call, MemoryJob, MemoryModel, MemoryQueue
from pipeline_assets.jobqueue.memory_transitions import MAX_DOUBLINGS
from pipeline_assets.jobqueue.outcomes import BreakerFailure
from pipeline_assets.jobqueue.status import JobStatus
from pipeline_assets.providers import ModelSpec, ProviderError
from pipeline_assets.registry.models import ModelRetired

WAITING = (JobStatus.PENDING, JobStatus.RETRY)


class MemoryJobStore:
    """One model's queue in ``queue``, as one worker sees it (``scope``: doc_pks)."""

    def __init__(
        self,
        queue: MemoryQueue,
        *,
        model_id: str,
        worker_id: str = "w",
        backoff_base: float = 0.0,
        backoff_cap: float = 0.0,
        worker_run: str | None = None,
        scope: Sequence[int] | None = None,
        observers: Sequence[JobObserver] = (),
    ) -> None:
        self.queue = queue
        self.model_id = model_id
        self.worker_id = worker_id
        self.worker_run = worker_run
        self.scope = list(scope) if scope is not None else None
        self.observers = list(observers)
        self._base = backoff_base
        self._cap = backoff_cap

    @property
    def claimed(self) -> int:
        return sum(getattr(o, "claimed_jobs", 0) for o in self.observers)

    # -- the model ---------------------------------------------------------------------
    def register_model(self, spec: ModelSpec) -> int | None:
        with self.queue.lock:
            model = self.queue.models.setdefault(self.model_id, MemoryModel(spec.dimension))
            if not model.active:
                raise ModelRetired(self.model_id)
            return model.dimension

    def record_dimension(self, dimension: int) -> int | None:
        with self.queue.lock:
            model = self.queue.models[self.model_id]
            if model.dimension is None:
                model.dimension = dimension
            return model.dimension

    # -- the queue ---------------------------------------------------------------------
    def claim(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedJob]:
        q = self.queue
        with q.lock:
            now = q.now()
            due = sorted(
                (
                    j
                    for j in q.jobs.values()
                    if j.model_id == self.model_id
                    and j.status in WAITING
                    and j.available_at <= now
                    and q.in_scope(j, self.scope)
                ),
                key=lambda j: (j.available_at, j.job_id),
            )
            breaker = q.breaker(self.model_id)
            probe = False
            if breaker.tripped and breaker.paused_until <= now and breaker.probe_until <= now and due:
                breaker.probe_until, breaker.probe_owner, probe = now + lease_seconds, owner, True
            if not q.active(self.model_id) or ((breaker.tripped or breaker.paused_until > now) and not probe):
                due = []
            jobs = [self._take(j, owner, now + lease_seconds, probe) for j in due[:limit]]
            if not jobs and breaker.probe_owner == owner:
                breaker.probe_until, breaker.probe_owner = NEVER, None
        if jobs:
            tell(self.observers, "claimed", jobs)
        return jobs

    def _take(self, job: MemoryJob, owner: str, expires: float, probe: bool) -> ClaimedJob:
        job.status, job.lease_owner, job.lease_expires_at = JobStatus.PROCESSING, owner, expires
        job.attempts += 1
        text, tokens = self.queue.texts.get(job.chunk_checksum, (None, None))
        return ClaimedJob(
            job.job_id,
            job.chunk_checksum,
            job.attempts,
            job.max_attempts,
            text,
            tokens,
            probe,
            job.throttles,
            job.isolate,
            job.faults,
            job.error_class in CRASH_ERRORS,
        )

    def apply(self, owner: str, changes: Sequence[Change], *, answer: Answer | None = None) -> dict[int, str]:
        applied: list[tuple[Change, dict[int, str]]] = []
        with self.queue.lock:
            for change in merged(changes):
                held = [
                    self.queue.jobs[i]
                    for i in change.job_ids
                    if i in self.queue.jobs
                    and self.queue.jobs[i].status == JobStatus.PROCESSING
                    and self.queue.jobs[i].lease_owner == owner
                ]
                applied.extend(memory_transitions.apply(self.queue, change, held))
            if answer is not None:
                self._settle(answer.call_id, "ok", 200, answer.latency, ledger.BILLED, answer.tokens)
        for change, became in applied:
            tell(self.observers, "applied", change, became)
        return {i: s for _, became in applied for i, s in became.items()}

    def give_back_all(self, held: Sequence[tuple[str, list[int]]]) -> None:
        for owner, ids in held:
            self.apply(owner, [GiveBack(tuple(ids))])

    def release_probe(self, owner: str) -> None:
        with self.queue.lock:
            breaker = self.queue.breaker(self.model_id)
            if breaker.probe_owner == owner:
                breaker.probe_until, breaker.probe_owner = NEVER, None

    def outstanding(self) -> bool:
        with self.queue.lock:
            return any(
                j.model_id == self.model_id and (j.status in WAITING or j.status == JobStatus.PROCESSING)
                for j in self.queue.jobs.values()
            )

    def ingest_running(self) -> bool:
        return self.queue.ingesting

    def rescue(self, rescuer: str | None = None) -> int:
        with self.queue.lock:
            rescued = memory_transitions.rescue(self.queue, rescuer, base=self._base, cap=self._cap)
        if rescued:
            tell(self.observers, "rescued", rescued)
        return rescued

    def extend_leases(self, held: Sequence[tuple[str, list[int]]], lease_seconds: float) -> None:
        with self.queue.lock:
            expires = self.queue.now() + lease_seconds
            for owner, ids in held:
                for i in ids:
                    job = self.queue.jobs.get(i)
                    if job is not None and job.status == JobStatus.PROCESSING and job.lease_owner == owner:
                        job.lease_expires_at = expires

    # -- spend and the provider's state ----------------------------------------------------
    def record_send(self, jobs: Sequence[ClaimedJob], tokens: int) -> int:
        with self.queue.lock:
            self.queue.calls.append(Call(self.model_id, self.worker_run, tuple(j.chunk_checksum for j in jobs), tokens))
            return len(self.queue.calls)

    def record_outcome(
        self, call_id: int, *, outcome: str, status: int | None, latency: float, billed: str, tokens: int | None = None
    ) -> None:
        with self.queue.lock:
            self._settle(call_id, outcome, status, latency, billed, tokens)

    def _settle(
        self, call_id: int, outcome: str, status: int | None, latency: float, billed: str, tokens: int | None
    ) -> None:
        call = self.queue.calls[call_id - 1]
        if call.answered:
            return
        call.outcome, call.status, call.latency_ms, call.billed = outcome, status, int(latency * 1000), billed
        call.tokens, call.answered = call.tokens if tokens is None else tokens, True

    def record_failure(self, call_id: int, err: ProviderError, latency: float, prefix: str = "") -> None:
        billed, tokens = failure_billing(err)
        self.record_outcome(
            call_id, outcome=prefix + err.error_class, status=err.status, latency=latency, billed=billed, tokens=tokens
        )

    def tokens_today_of_others(self) -> int:
        with self.queue.lock:
            return sum(
                c.tokens
                for c in self.queue.calls
                if c.model_id == self.model_id and (self.worker_run is None or c.worker_run != self.worker_run)
            )

    def provider_failure(self, breaker: BreakerFailure) -> None:
        q = self.queue
        with q.lock:
            now, state = q.now(), q.breaker(self.model_id)
            if breaker.pause_only:
                pause = (
                    breaker.floor
                    if breaker.floor > 0
                    else q.rng.random() * min(BREAKER_PROBE_INTERVAL, self._cap, self._base * 2)
                )
                state.paused_until = max(state.paused_until, now + pause)
                return
            was_tripped = state.tripped
            state.consecutive_failures += 1
            trips = breaker.trip or state.consecutive_failures >= BREAKER_THRESHOLD
            state.tripped = state.tripped or trips
            if trips:
                pause = (
                    breaker.floor
                    if breaker.floor > 0
                    else (0.5 + q.rng.random() / 2)
                    * min(
                        BREAKER_PROBE_INTERVAL,
                        self._cap,
                        self._base * 2 ** min(state.consecutive_failures, MAX_DOUBLINGS),
                    )
                )
                state.paused_until = max(state.paused_until, now + pause)
            if was_tripped or trips:
                state.probe_until, state.probe_owner = NEVER, None

    def provider_healthy(self) -> None:
        with self.queue.lock:
            state = self.queue.breaker(self.model_id)
            if (state.consecutive_failures or state.tripped) and (
                not state.tripped or state.paused_until <= self.queue.now()
            ):
                state.consecutive_failures, state.tripped = 0, False
                state.probe_until, state.probe_owner = NEVER, None
            state.unusable_answers = 0

    def provider_unusable(self, *, count: bool = True) -> int:
        with self.queue.lock:
            state = self.queue.breaker(self.model_id)
            state.unusable_answers += count
            return state.unusable_answers
