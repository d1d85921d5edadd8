"""The worker's view of the database: one short step per method.

Each method takes a pooled connection only for its own statement (or short
transaction), so a slow provider call holds no connection, no transaction and
no row lock. Underneath: ``jobs.transitions`` (the guarded state machine),
``jobs.ledger`` (spend) and ``jobs.models`` (the model registry).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import psycopg
from psycopg.rows import class_row
from psycopg_pool import ConnectionPool

from pipeline_assets.jobs import ledger, models, transitions
from pipeline_assets.jobs.decisions import BreakerFailure
from pipeline_assets.jobs.transitions import ClaimedJob
from pipeline_assets.providers import ModelSpec, ProviderError
from pipeline_assets.settings import BREAKER_THRESHOLD
from pipeline_assets.store import queries

JOBS = queries.load("jobs")  # claim_scoped; the rest through jobs.transitions

# Completion transactions retried on a deadlock with a concurrent ingest.
COMPLETE_RETRIES = 3


class JobStore:
    def __init__(self, pool: ConnectionPool, *, model_id: str, worker_id: str, backoff_base: float,
                 backoff_cap: float, run: str | None = None, scope: Sequence[int] | None = None) -> None:
        self.pool = pool
        # Claim only the jobs of these documents' chunks (doc_pk), when set: a Dagster run's own partitions.
        self.scope = list(scope) if scope is not None else None
        self.model_id = model_id
        self.worker_id = worker_id
        self.run = run  # this worker run (its lease-owner prefix), recorded with its sends
        self._base = backoff_base  # the breaker's pause without a Retry-After
        self._cap = backoff_cap

    # -- the model ------------------------------------------------------------------
    def register_model(self, spec: ModelSpec) -> int | None:
        """Register the model (ModelRetired if it was retired); return its recorded dimension."""
        with self.pool.connection() as conn:
            models.ensure_model(conn, spec)
            return models.model_dimension(conn, self.model_id)

    def record_dimension(self, dimension: int) -> int | None:
        """First answer of a model of unknown dimension; returns the recorded one (first wins)."""
        with self.pool.connection() as conn:
            models.record_dimension(conn, self.model_id, dimension)
            return models.model_dimension(conn, self.model_id)

    # -- the queue --------------------------------------------------------------------
    def claim(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedJob]:
        """Claim a batch. A claim that took the half-open probe slot but found
        nothing (a job taken meanwhile) frees the slot at once."""
        if self.scope is not None:
            return self._claim_scoped(owner=owner, limit=limit, lease_seconds=lease_seconds)
        with self.pool.connection() as conn:
            jobs = transitions.claim(conn, model_id=self.model_id, owner=owner, limit=limit,
                                     lease_seconds=lease_seconds)
            if not jobs:
                transitions.release_probe(conn, self.model_id, owner)
            return jobs

    def _claim_scoped(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedJob]:
        """``claim`` limited to the scope's jobs (sql/queries/jobs.sql: claim_scoped), same probe rules."""
        with self.pool.connection() as conn:
            with conn.cursor(row_factory=class_row(ClaimedJob)) as cur:
                jobs = cur.execute(JOBS.claim_scoped, {"model": self.model_id, "owner": owner, "limit": limit,
                                                       "lease": lease_seconds, "docs": self.scope}).fetchall()
            if not jobs:
                transitions.release_probe(conn, self.model_id, owner)
            return jobs

    def release_probe(self, owner: str) -> None:
        """A probe claim ended without closing the breaker (a 400, nothing sent,
        a fault of ours): the next claim may probe at once."""
        with self.pool.connection() as conn:
            transitions.release_probe(conn, self.model_id, owner)

    def outstanding(self) -> bool:
        """Whether the model has jobs waiting or under a lease."""
        with self.pool.connection() as conn:
            waiting, held = transitions.outstanding(conn, self.model_id)
        return waiting or held

    def rescue(self, rescuer: str | None = None) -> int:
        """Rescue expired leases and the claims of dead workers (``rescuer``: this
        worker's owner prefix, a live worker that may judge others dead); a
        rescued job waits out the backoff of its attempt."""
        with self.pool.connection() as conn:
            return sum(transitions.rescue_expired(conn, rescuer=rescuer, base=self._base, cap=self._cap).values())

    def extend_leases(self, held: Sequence[tuple[str, list[int]]], lease_seconds: float) -> None:
        with self.pool.connection() as conn:
            for owner, ids in held:
                transitions.extend_lease(conn, owner=owner, job_ids=ids, lease_seconds=lease_seconds)

    # -- transitions of held jobs ---------------------------------------------------------
    def supersede(self, *, owner: str, job_ids: Sequence[int]) -> list[int]:
        with self.pool.connection() as conn:
            return transitions.supersede_held(conn, owner=owner, job_ids=job_ids)

    def give_back(self, *, owner: str, job_ids: Sequence[int], delay: float = 0.0,
                  error_class: str | None = None, message: str | None = None,
                  throttled: bool = False) -> list[int]:
        if not job_ids:
            return []
        with self.pool.connection() as conn:
            return transitions.give_back(conn, owner=owner, job_ids=job_ids, delay=delay,
                                         error_class=error_class, message=message, throttled=throttled)

    def mark_isolated(self, *, owner: str, job_ids: Sequence[int]) -> None:
        with self.pool.connection() as conn:
            transitions.mark_isolated(conn, owner=owner, job_ids=job_ids)

    def give_back_all(self, held: Sequence[tuple[str, list[int]]]) -> None:
        with self.pool.connection() as conn:
            for owner, ids in held:
                transitions.give_back(conn, owner=owner, job_ids=ids)

    def fail_retryable(self, *, owner: str, job_ids: Sequence[int], delays: Sequence[float], error_class: str,
                       message: str) -> dict[int, str]:
        with self.pool.connection() as conn:
            return transitions.fail_retryable(conn, owner=owner, job_ids=job_ids, delays=delays,
                                              error_class=error_class, message=message)

    def fail_terminal(self, *, owner: str, job_ids: Sequence[int], error_class: str, message: str) -> list[int]:
        with self.pool.connection() as conn:
            return transitions.fail_terminal(conn, owner=owner, job_ids=job_ids, error_class=error_class,
                                             message=message)

    def complete(self, *, owner: str, jobs: Sequence[ClaimedJob], vectors: Sequence[np.ndarray], tokens: int,
                 latency: float, call_id: int) -> tuple[list[int], list[int]]:
        """Store the vectors of jobs still held and wanted; returns (ready, superseded).

        One transaction, pipelined: the call's outcome (its send was recorded
        before the call) and the completion travel together and commit
        together; if they never commit, the send stays counted as possibly
        billed. A deadlock with a concurrent ingest is retried: the vectors
        are already paid for.
        """
        with self.pool.connection() as conn:
            for attempt in range(COMPLETE_RETRIES):
                try:
                    with conn.pipeline(), conn.transaction():
                        ledger.record_outcome(conn, call_id=call_id, model_id=self.model_id,
                                              checksums=[j.chunk_checksum for j in jobs], outcome="ok", status=200,
                                              latency=latency, billed=ledger.BILLED, tokens=tokens)
                        ready, superseded = transitions.complete(conn, owner=owner,
                                                                 job_ids=[j.job_id for j in jobs], vectors=vectors)
                    break
                except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                    if attempt == COMPLETE_RETRIES - 1:
                        raise
        return ready, superseded

    # -- spend and the provider's state --------------------------------------------------------
    def record_send(self, jobs: Sequence[ClaimedJob], tokens: int) -> int:
        """Before a request goes out: count its send (committed on its own); returns the call id."""
        with self.pool.connection() as conn:
            return ledger.record_send(conn, model_id=self.model_id, worker_id=self.worker_id, run=self.run,
                                      checksums=[j.chunk_checksum for j in jobs], tokens=tokens)

    def record_outcome(self, call_id: int, jobs: Sequence[ClaimedJob], *, outcome: str, status: int | None,
                       latency: float, billed: str, tokens: int | None = None) -> None:
        with self.pool.connection() as conn:
            ledger.record_outcome(conn, call_id=call_id, model_id=self.model_id,
                                  checksums=[j.chunk_checksum for j in jobs], outcome=outcome, status=status,
                                  latency=latency, billed=billed, tokens=tokens)

    def record_failure(self, call_id: int, jobs: Sequence[ClaimedJob], err: ProviderError, latency: float,
                       prefix: str = "") -> None:
        """Settle a failed send: an ambiguous failure (timeout, dropped answer) may
        have been billed and keeps its estimated tokens; a refusal was not billed."""
        maybe = err.billed_maybe
        self.record_outcome(call_id, jobs, outcome=prefix + err.error_class, status=err.status, latency=latency,
                            billed=ledger.MAYBE_BILLED if maybe else ledger.NOT_BILLED, tokens=None if maybe else 0)

    def tokens_today_of_others(self) -> int:
        """The model's tokens today, except this worker run's (it counts its own as they are answered)."""
        with self.pool.connection() as conn:
            return ledger.tokens_today(conn, self.model_id, excluding_run=self.run)

    def provider_failure(self, breaker: BreakerFailure) -> None:
        with self.pool.connection() as conn:
            transitions.provider_failure(conn, self.model_id, trip=breaker.trip, floor=breaker.floor,
                                         base=self._base, cap=self._cap, threshold=BREAKER_THRESHOLD)

    def provider_healthy(self) -> None:
        with self.pool.connection() as conn:
            transitions.provider_healthy(conn, self.model_id)
