"""The state behind ``MemoryJobStore``: jobs, content, models, the breaker and
the ledger of one process, in memory (what the database holds for
``PostgresJobStore``).

``MemoryQueue`` is shared by any number of stores (workers) and guarded by one
lock; time is its ``clock`` (seconds, injectable: a test advances it) and
jitter its ``rng``. Content is "wanted" while some chunk carries its checksum
(``add_content`` / ``drop_content``), as app.chunks decides for PostgreSQL.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline_assets.jobqueue.status import JobStatus

# A job claimed under one of these errors was last lost with its worker (jobs.sql rescue_expired).
CRASH_ERRORS = ("lease_expired", "worker_dead")
NEVER = float("-inf")


@dataclass
class MemoryJob:
    """One row of the queue (app.embedding_jobs)."""

    job_id: int
    chunk_checksum: bytes
    model_id: str
    max_attempts: int
    status: str = JobStatus.PENDING
    attempts: int = 0
    available_at: float = NEVER
    lease_owner: str | None = None
    lease_expires_at: float | None = None
    throttles: int = 0
    faults: int = 0
    isolate: bool = False
    error_class: str | None = None
    error_message: str | None = None

    def release(self, status: str) -> None:
        """Leave processing for ``status``: the lease is gone."""
        self.status, self.lease_owner, self.lease_expires_at = status, None, None


@dataclass
class MemoryModel:
    dimension: int | None
    active: bool = True


@dataclass
class Breaker:
    """One model's provider state (app.provider_state)."""

    consecutive_failures: int = 0
    tripped: bool = False
    paused_until: float = NEVER
    probe_until: float = NEVER
    probe_owner: str | None = None
    unusable_answers: int = 0


@dataclass
class Call:
    """One provider call in the ledger (app.provider_calls)."""

    model_id: str
    worker_run: str | None
    checksums: tuple[bytes, ...]
    tokens: int
    outcome: str = "sent"
    status: int | None = None
    latency_ms: int | None = None
    billed: str = "maybe"
    answered: bool = False


@dataclass
class Beats:
    """One worker's liveness (app.workers): beating since, last beat, alive until."""

    alive_since: float
    beat_at: float
    alive_until: float


@dataclass
class MemoryQueue:
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    lock: threading.RLock = field(default_factory=threading.RLock)
    jobs: dict[int, MemoryJob] = field(default_factory=dict)
    texts: dict[bytes, tuple[str, int | None]] = field(default_factory=dict)  # wanted content
    docs: dict[int, set[bytes]] = field(default_factory=dict)  # doc_pk -> its chunks' checksums
    models: dict[str, MemoryModel] = field(default_factory=dict)
    breakers: dict[str, Breaker] = field(default_factory=dict)
    vectors: dict[tuple[bytes, str], Any] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    workers: dict[str, Beats] = field(default_factory=dict)  # by owner prefix
    ingesting: bool = False  # an ingest is running (app.running_ingests holds a live row)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def now(self) -> float:
        return self.clock()

    # -- content and work (what ingest does for PostgreSQL) ------------------------------
    def add_model(self, model_id: str, dimension: int | None = None) -> None:
        with self.lock:
            self.models.setdefault(model_id, MemoryModel(dimension))

    def add_content(self, doc_pk: int, texts: Sequence[tuple[bytes, str, int | None]]) -> None:
        """Chunks (checksum, text, tokens) of a document: their content is wanted."""
        with self.lock:
            for checksum, text, tokens in texts:
                self.texts[checksum] = (text, tokens)
                self.docs.setdefault(doc_pk, set()).add(checksum)

    def drop_content(self, checksum: bytes) -> None:
        """No chunk carries ``checksum`` any more."""
        with self.lock:
            self.texts.pop(checksum, None)
            for sums in self.docs.values():
                sums.discard(checksum)

    def enqueue(self, checksums: Sequence[bytes], *, max_attempts: int) -> list[int]:
        """A job per (checksum, active model) that has none; returns every job id of them, in order."""
        with self.lock:
            known = {(j.chunk_checksum, j.model_id): j.job_id for j in self.jobs.values()}
            out = []
            for checksum in checksums:
                for model_id, model in self.models.items():
                    if not model.active:
                        continue
                    if (checksum, model_id) not in known:
                        job = MemoryJob(next(self._ids), checksum, model_id, max_attempts, available_at=self.now())
                        self.jobs[job.job_id] = job
                        known[(checksum, model_id)] = job.job_id
                    out.append(known[(checksum, model_id)])
            return out

    def retire(self, model_id: str) -> None:
        """The model is retired: its waiting jobs are superseded (held and ready ones are left)."""
        with self.lock:
            self.models[model_id].active = False
            for job in self.jobs.values():
                if job.model_id == model_id and job.status in (JobStatus.PENDING, JobStatus.RETRY):
                    job.status = JobStatus.SUPERSEDED

    def beat(self, owner_prefix: str, dead_after: float) -> None:
        """A worker's liveness beat (workers.sql beat): a beat after a gap restarts alive_since."""
        with self.lock:
            now, w = self.now(), self.workers.get(owner_prefix)
            since = now if w is None or w.alive_until < now else w.alive_since
            self.workers[owner_prefix] = Beats(since, now, now + dead_after)

    # -- reads shared by the stores ----------------------------------------------------
    def wanted(self, job: MemoryJob) -> bool:
        return job.chunk_checksum in self.texts and self.active(job.model_id)

    def active(self, model_id: str) -> bool:
        model = self.models.get(model_id)
        return model is not None and model.active

    def breaker(self, model_id: str) -> Breaker:
        return self.breakers.setdefault(model_id, Breaker())

    def in_scope(self, job: MemoryJob, docs: Sequence[int] | None) -> bool:
        return docs is None or any(job.chunk_checksum in self.docs.get(d, ()) for d in docs)

    def dead(self, owner: str, rescuer: str | None) -> bool:
        """Whether the worker of lease ``owner`` stopped beating while ``rescuer``, alive, could
        beat (jobs.sql rescue_expired: a silence of every worker condemns nobody)."""
        now, r = self.now(), self.workers.get(rescuer or "")
        if r is None or r.alive_until < now:
            return False
        window_start = now - (r.alive_until - r.beat_at)
        return any(
            owner.startswith(prefix)
            and w.alive_until < now
            and (r.alive_since <= w.alive_until or r.alive_since <= window_start)
            for prefix, w in self.workers.items()
        )
