"""What the contract suite of ``JobStore`` needs of each implementation's world:
make a store, enqueue work, read a job back, move time, drop content, read a
call of the ledger. ``MemoryHarness`` drives a ``MemoryQueue`` with a manual
clock; ``PostgresHarness`` drives the real database and moves time by shifting
the rows' timestamps back (the database clock cannot be set).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline_assets.jobqueue import leases, transitions
from pipeline_assets.jobqueue.job_store import JobStore
from pipeline_assets.jobqueue.memory_job_store import MemoryJobStore
from pipeline_assets.jobqueue.memory_queue import MemoryQueue
from pipeline_assets.jobqueue.pg_job_store import PostgresJobStore
from pipeline_assets.providers import ModelSpec
from pipeline_assets.registry import models

SPEC = ModelSpec(
    provider="test", name="m", dimension=4, max_input_tokens=100, max_batch_inputs=10, max_batch_tokens=1000
)
MODEL = SPEC.model_id
CHUNK_TOKENS = 3
LEASE = 30.0
A, B = "w/a/1", "w/b/1"  # two lease owners (claims) of two workers

_labels = itertools.count()


@dataclass(frozen=True)
class Row:
    """A job as the contract reads it."""

    status: str
    attempts: int
    lease_owner: str | None
    throttles: int
    faults: int
    isolate: bool
    error_class: str | None
    has_vector: bool


class ManualClock:
    """Seconds that pass only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def store_options(
    *,
    scope: Sequence[int] | None = None,
    observers: Sequence = (),
    base: float = 0.0,
    cap: float = 0.0,
    worker_run: str | None = None,
) -> dict[str, Any]:
    """The keyword arguments both stores take: a contract test's options, no backoff by default."""
    return {
        "model_id": MODEL,
        "worker_id": "w",
        "backoff_base": base,
        "backoff_cap": cap,
        "worker_run": worker_run,
        "scope": scope,
        "observers": observers,
    }


def _checksums(n: int) -> list[bytes]:
    return [hashlib.sha256(f"chunk-{next(_labels)}".encode()).digest() for _ in range(n)]


class MemoryHarness:
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.queue = MemoryQueue(clock=self.clock)
        self.queue.add_model(MODEL, SPEC.dimension)
        self._docs = itertools.count(1)

    def store(self, **options: Any) -> JobStore:
        """A store of the model ``MODEL`` for the worker "w" (see ``store_options``)."""
        return MemoryJobStore(self.queue, **store_options(**options))

    def enqueue(self, n: int, *, max_attempts: int = 5) -> tuple[int, list[int]]:
        """A new document of ``n`` new chunks, enqueued: (its doc_pk, its job ids in queue order)."""
        doc, sums = next(self._docs), _checksums(n)
        self.queue.add_content(doc, [(s, f"text of {s.hex()[:12]}", CHUNK_TOKENS) for s in sums])
        return doc, sorted(self.queue.enqueue(sums, max_attempts=max_attempts))

    def job(self, job_id: int) -> Row:
        j = self.queue.jobs[job_id]
        return Row(
            j.status,
            j.attempts,
            j.lease_owner,
            j.throttles,
            j.faults,
            j.isolate,
            j.error_class,
            (j.chunk_checksum, j.model_id) in self.queue.vectors,
        )

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    def drop_content(self, job_id: int) -> None:
        self.queue.drop_content(self.queue.jobs[job_id].chunk_checksum)

    def beat(self, prefix: str, dead_after: float) -> None:
        self.queue.beat(prefix, dead_after)

    def call(self, call_id: int) -> tuple[str, str, int]:
        c = self.queue.calls[call_id - 1]
        return c.outcome, c.billed, c.tokens


class PostgresHarness:
    def __init__(self, conn, pool) -> None:
        self.conn, self.pool = conn, pool
        models.ensure_model(conn, SPEC)

    def store(self, **options: Any) -> JobStore:
        """A store of the model ``MODEL`` for the worker "w" (see ``store_options``)."""
        return PostgresJobStore(self.pool, **store_options(**options))

    def enqueue(self, n: int, *, max_attempts: int = 5) -> tuple[int, list[int]]:
        sums = _checksums(n)
        source = self.conn.execute(
            "INSERT INTO app.sources (root) VALUES ('/contract') ON CONFLICT (root) DO UPDATE SET root = EXCLUDED.root"
            " RETURNING source_id"
        ).fetchone()[0]
        name = f"doc-{next(_labels)}"
        doc = self.conn.execute(
            "INSERT INTO app.documents (source_id, document_id, source_uri, status) VALUES (%s, %s, %s, 'current')"
            " RETURNING doc_pk",
            (source, name, f"file:///{name}"),
        ).fetchone()[0]
        for i, s in enumerate(sums):
            self.conn.execute(
                "INSERT INTO app.chunks (doc_pk, chunk_index, chunk_checksum, text, token_count, char_start, char_end)"
                " VALUES (%s, %s, %s, %s, %s, 0, 10)",
                (doc, i, s, f"text of {s.hex()[:12]}", CHUNK_TOKENS),
            )
        transitions.enqueue_for_docs(self.conn, [doc], max_attempts)
        ids = dict(
            self.conn.execute(
                "SELECT chunk_checksum, job_id FROM app.embedding_jobs"
                " WHERE model_id = %s AND chunk_checksum = ANY(%s)",
                (MODEL, sums),
            ).fetchall()
        )
        return doc, sorted(ids[s] for s in sums)

    def job(self, job_id: int) -> Row:
        r = self.conn.execute(
            "SELECT j.status, j.attempts, j.lease_owner, j.throttles, j.faults, j.isolate, j.error_class,"
            " e.chunk_checksum IS NOT NULL FROM app.embedding_jobs j LEFT JOIN app.embeddings e"
            " ON e.chunk_checksum = j.chunk_checksum AND e.model_id = j.model_id WHERE j.job_id = %s",
            (job_id,),
        ).fetchone()
        return Row(*r)

    def advance(self, seconds: float) -> None:
        shift = {"s": seconds}
        self.conn.execute(
            "UPDATE app.embedding_jobs SET available_at = available_at - make_interval(secs => %(s)s),"
            " lease_expires_at = lease_expires_at - make_interval(secs => %(s)s)",
            shift,
        )
        self.conn.execute(
            "UPDATE app.provider_state SET paused_until = paused_until - make_interval(secs => %(s)s),"
            " probe_until = probe_until - make_interval(secs => %(s)s)",
            shift,
        )
        self.conn.execute(
            "UPDATE app.workers SET alive_since = alive_since - make_interval(secs => %(s)s),"
            " beat_at = beat_at - make_interval(secs => %(s)s),"
            " alive_until = alive_until - make_interval(secs => %(s)s)",
            shift,
        )

    def beat(self, prefix: str, dead_after: float) -> None:
        self.conn.execute(
            leases.WORKERS.beat,
            {"prefix": prefix, "worker": prefix, "model": MODEL, "host": "h", "pid": 1, "dead_after": dead_after},
        )

    def drop_content(self, job_id: int) -> None:
        self.conn.execute(
            "DELETE FROM app.chunks WHERE chunk_checksum ="
            " (SELECT chunk_checksum FROM app.embedding_jobs WHERE job_id = %s)",
            (job_id,),
        )

    def call(self, call_id: int) -> tuple[str, str, int]:
        return self.conn.execute(
            "SELECT outcome, billed, tokens FROM app.provider_calls WHERE call_id = %s", (call_id,)
        ).fetchone()


def vec(x: float = 1.0) -> np.ndarray:
    return np.array([x, 1.0, 2.0, 3.0], dtype=np.float32)


def ids(jobs) -> list[int]:
    """The job ids of a claim, sorted (a claim returns its jobs in no particular order)."""
    return sorted(j.job_id for j in jobs)


def claim_expired(world, store: JobStore, ids_: list[int]) -> None:
    """A claims, its lease expires, the rescue returns the jobs and B claims them."""
    assert ids(store.claim(owner=A, limit=10, lease_seconds=LEASE)) == sorted(ids_)
    world.advance(LEASE + 1)
    assert store.rescue() == len(ids_)
    assert ids(store.claim(owner=B, limit=10, lease_seconds=LEASE)) == sorted(ids_)
