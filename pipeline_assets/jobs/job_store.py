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
from psycopg_pool import ConnectionPool

from pipeline_assets.jobs import ledger, models, transitions
from pipeline_assets.jobs.decisions import BreakerFailure
from pipeline_assets.jobs.transitions import ClaimedJob
from pipeline_assets.providers import ModelSpec
from pipeline_assets.settings import BREAKER_THRESHOLD

# Completion transactions retried on a deadlock with a concurrent ingest.
COMPLETE_RETRIES = 3


class JobStore:
    def __init__(self, pool: ConnectionPool, *, model_id: str, worker_id: str, backoff_base: float,
                 backoff_cap: float) -> None:
        self.pool = pool
        self.model_id = model_id
        self.worker_id = worker_id
        self._base = backoff_base  # the breaker's pause without a Retry-After
        self._cap = backoff_cap

    # -- the model ------------------------------------------------------------------
    def register_model(self, spec: ModelSpec) -> int | None:
        """Register (and activate) the model; return its recorded dimension."""
        with self.pool.connection() as conn:
            models.ensure_model(conn, spec)
            return models.model_dimension(conn, self.model_id)

    def record_dimension(self, dimension: int) -> int | None:
        """First answer of a model of unknown dimension; returns the recorded one (first wins)."""
        with self.pool.connection() as conn:
            models.record_dimension(conn, self.model_id, dimension)
            return models.model_dimension(conn, self.model_id)

    def ensure_index(self, dimension: int) -> None:
        with self.pool.connection() as conn:
            models.ensure_index(conn, self.model_id, dimension)

    # -- the queue --------------------------------------------------------------------
    def claim(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedJob]:
        with self.pool.connection() as conn:
            return transitions.claim(conn, model_id=self.model_id, owner=owner, limit=limit,
                                     lease_seconds=lease_seconds)

    def outstanding(self) -> bool:
        """Whether the model has jobs waiting or under a lease."""
        with self.pool.connection() as conn:
            waiting, held = transitions.outstanding(conn, self.model_id)
        return waiting or held

    def rescue(self) -> int:
        with self.pool.connection() as conn:
            return sum(transitions.rescue_expired(conn).values())

    def extend_leases(self, held: Sequence[tuple[str, list[int]]], lease_seconds: float) -> None:
        with self.pool.connection() as conn:
            for owner, ids in held:
                transitions.extend_lease(conn, owner=owner, job_ids=ids, lease_seconds=lease_seconds)

    # -- transitions of held jobs ---------------------------------------------------------
    def supersede(self, *, owner: str, job_ids: Sequence[int]) -> list[int]:
        with self.pool.connection() as conn:
            return transitions.supersede_held(conn, owner=owner, job_ids=job_ids)

    def give_back(self, *, owner: str, job_ids: Sequence[int], delay: float = 0.0,
                  error_class: str | None = None, message: str | None = None) -> list[int]:
        if not job_ids:
            return []
        with self.pool.connection() as conn:
            return transitions.give_back(conn, owner=owner, job_ids=job_ids, delay=delay,
                                         error_class=error_class, message=message)

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
                 latency: float) -> tuple[list[int], list[int]]:
        """Store the vectors of jobs still held and wanted; returns (ready, superseded).

        One transaction, pipelined: the ledger row and the completion travel
        together and commit together. A deadlock with a concurrent ingest is
        retried: the vectors are already paid for.
        """
        with self.pool.connection() as conn:
            for attempt in range(COMPLETE_RETRIES):
                try:
                    with conn.pipeline(), conn.transaction():
                        ledger.record_call(conn, model_id=self.model_id, worker_id=self.worker_id, jobs=jobs,
                                           tokens=tokens, outcome="ok", status=200, latency=latency, billed=True)
                        ready, superseded = transitions.complete(conn, owner=owner,
                                                                 job_ids=[j.job_id for j in jobs], vectors=vectors)
                    break
                except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                    if attempt == COMPLETE_RETRIES - 1:
                        raise
        return ready, superseded

    # -- spend and the provider's state --------------------------------------------------------
    def record_call(self, *, jobs: Sequence[ClaimedJob], tokens: int, outcome: str, status: int | None,
                    latency: float, billed: bool) -> None:
        with self.pool.connection() as conn:
            ledger.record_call(conn, model_id=self.model_id, worker_id=self.worker_id, jobs=jobs, tokens=tokens,
                               outcome=outcome, status=status, latency=latency, billed=billed)

    def tokens_today(self) -> int:
        with self.pool.connection() as conn:
            return ledger.tokens_today(conn, self.model_id)

    def provider_failure(self, breaker: BreakerFailure) -> None:
        with self.pool.connection() as conn:
            transitions.provider_failure(conn, self.model_id, trip=breaker.trip, floor=breaker.floor,
                                         base=self._base, cap=self._cap, threshold=BREAKER_THRESHOLD)

    def provider_healthy(self) -> None:
        with self.pool.connection() as conn:
            transitions.provider_healthy(conn, self.model_id)
