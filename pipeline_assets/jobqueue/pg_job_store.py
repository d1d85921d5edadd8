"""``JobStore`` on PostgreSQL: the worker's view of the database.

Each method takes a pooled connection only for its own statement (or short
transaction), so a slow provider call holds no connection, no transaction and
no row lock. ``claim`` takes a batch (of the whole queue or of a scope of
documents); ``apply`` applies a batch of transitions (``jobqueue.changes``) of a
claim, one statement per kind, and returns what each job became; observers
(``jobqueue.job_log``, the worker's report) are told what was claimed and applied.
Underneath: ``jobqueue.transitions`` (the guarded state machine), ``jobqueue.ledger``
(spend) and ``registry.models`` (the model registry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import psycopg
from psycopg_pool import ConnectionPool

from pipeline_assets.jobqueue import ledger, provider_state, running_ingests, transitions
from pipeline_assets.jobqueue.breaker_config import BREAKER_PROBE_INTERVAL, BREAKER_THRESHOLD
from pipeline_assets.jobqueue.changes import Change, ClaimedJob, Complete, GiveBack, JobObserver, merged
from pipeline_assets.jobqueue.job_store import Answer, failure_billing, tell
from pipeline_assets.jobqueue.outcomes import BreakerFailure
from pipeline_assets.providers import ModelSpec, ProviderError
from pipeline_assets.registry import models

# Completion transactions retried on a deadlock with a concurrent ingest.
COMPLETE_RETRIES = 3


class PostgresJobStore:
    """``jobqueue.job_store.JobStore`` over a connection pool (the claim's SKIP LOCKED
    lets any number of workers share the queue)."""

    def __init__(
        self,
        pool: ConnectionPool,
        *,
        model_id: str,
        worker_id: str,
        backoff_base: float,
        backoff_cap: float,
        worker_run: str | None = None,
        scope: Sequence[int] | None = None,
        observers: Sequence[JobObserver] = (),
    ) -> None:
        self.pool = pool
        # Claim only the jobs of these documents' chunks (doc_pk), when set: a Dagster run's own partitions.
        self.scope = list(scope) if scope is not None else None
        self.model_id = model_id
        self.worker_id = worker_id
        self.worker_run = worker_run  # this worker run (its lease-owner prefix), recorded with its sends
        self.observers = list(observers)
        self._base = backoff_base  # the breaker's pause without a Retry-After
        self._cap = backoff_cap

    @property
    def claimed(self) -> int:
        """Jobs claimed through this store, as counted by an observer that counts them (metrics)."""
        return sum(getattr(o, "claimed_jobs", 0) for o in self.observers)

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
        """Claim a batch (of the scope, if any). A claim that took the half-open
        probe slot but found nothing (a job taken meanwhile) frees the slot at once."""
        with self.pool.connection() as conn:
            jobs = transitions.claim(
                conn, model_id=self.model_id, owner=owner, limit=limit, lease_seconds=lease_seconds, docs=self.scope
            )
            if not jobs:
                provider_state.release_probe(conn, self.model_id, owner)
        if jobs:
            self._tell("claimed", jobs)
        return jobs

    def apply(self, owner: str, changes: Sequence[Change], *, answer: Answer | None = None) -> dict[int, str]:
        """Apply the transitions of jobs held under ``owner`` in one transaction,
        one statement per kind; returns what each job became (a refused job is missing).

        With ``answer`` (a successful call), the call's outcome is settled in the
        ledger in the same transaction: by the completion's own statement when
        the answer stored vectors (``Complete.call``; a usual answer is then one
        statement in autocommit, one round trip), otherwise by its own statement,
        pipelined. Its send was recorded before the call, so if they never commit,
        the send stays counted as possibly billed. A deadlock with a concurrent
        ingest is retried: the vectors are already paid for.
        """
        if not any(c.job_ids for c in changes) and answer is None:
            return {}
        settle = answer
        if answer is not None and any(isinstance(c, Complete) and c.job_ids for c in changes):
            changes = [
                dataclasses.replace(c, call=answer.call_id, tokens=answer.tokens, latency_ms=int(answer.latency * 1000))
                if isinstance(c, Complete) and c.job_ids
                else c
                for c in changes
            ]
            settle = None
        with self.pool.connection() as conn:
            for attempt in range(COMPLETE_RETRIES):
                try:
                    if settle is None and len(merged(changes)) == 1:  # one statement: no BEGIN, no COMMIT
                        applied = transitions.apply(conn, owner, changes)
                        break
                    with conn.pipeline(), conn.transaction():
                        if settle is not None:
                            ledger.record_outcome(
                                conn,
                                call_id=settle.call_id,
                                outcome="ok",
                                status=200,
                                latency=settle.latency,
                                billed=ledger.BILLED,
                                tokens=settle.tokens,
                            )
                        applied = transitions.apply(conn, owner, changes)
                    break
                except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                    if attempt == COMPLETE_RETRIES - 1:
                        raise
        for change, became in applied:
            self._tell("applied", change, became)
        return transitions.became(applied)

    def give_back_all(self, held: Sequence[tuple[str, list[int]]]) -> None:
        """At shutdown: every claim still held goes back without using an attempt."""
        for owner, ids in held:
            self.apply(owner, [GiveBack(tuple(ids))])

    def release_probe(self, owner: str) -> None:
        """A probe claim ended without closing the breaker (a 400, nothing sent,
        a fault of ours): the next claim may probe at once."""
        with self.pool.connection() as conn:
            provider_state.release_probe(conn, self.model_id, owner)

    def outstanding(self) -> bool:
        """Whether the model has jobs waiting or under a lease."""
        with self.pool.connection() as conn:
            waiting, held = transitions.outstanding(conn, self.model_id)
        return waiting or held

    def ingest_running(self) -> bool:
        """Whether an ingest is running now (``running_ingests``: a row with a live beat)."""
        with self.pool.connection() as conn:
            return running_ingests.any_running(conn)

    def rescue(self, rescuer: str | None = None) -> int:
        """Rescue expired leases and the claims of dead workers (``rescuer``: this
        worker's owner prefix, a live worker that may judge others dead): a crash
        is a fault of the claim (``transitions.rescue_expired``); a rescued job
        waits out the backoff of its faults (of its attempts when charged)."""
        with self.pool.connection() as conn:
            n = sum(transitions.rescue_expired(conn, rescuer=rescuer, base=self._base, cap=self._cap).values())
        if n:
            self._tell("rescued", n)
        return n

    def extend_leases(self, held: Sequence[tuple[str, list[int]]], lease_seconds: float) -> None:
        with self.pool.connection() as conn:
            for owner, ids in held:
                transitions.extend_lease(conn, owner=owner, job_ids=ids, lease_seconds=lease_seconds)

    def _tell(self, event: str, *args: object) -> None:
        tell(self.observers, event, *args)

    # -- spend and the provider's state --------------------------------------------------------
    def record_send(self, jobs: Sequence[ClaimedJob], tokens: int) -> int:
        """Before a request goes out: count its send (committed on its own); returns the call id."""
        with self.pool.connection() as conn:
            return ledger.record_send(
                conn,
                model_id=self.model_id,
                worker_id=self.worker_id,
                worker_run=self.worker_run,
                checksums=[j.chunk_checksum for j in jobs],
                tokens=tokens,
            )

    def record_outcome(
        self, call_id: int, *, outcome: str, status: int | None, latency: float, billed: str, tokens: int | None = None
    ) -> None:
        with self.pool.connection() as conn:
            ledger.record_outcome(
                conn, call_id=call_id, outcome=outcome, status=status, latency=latency, billed=billed, tokens=tokens
            )

    def record_failure(self, call_id: int, err: ProviderError, latency: float, prefix: str = "") -> None:
        """Settle a failed send: an ambiguous failure (timeout, dropped answer) may
        have been billed and keeps its estimated tokens; a refusal was not billed."""
        billed, tokens = failure_billing(err)
        self.record_outcome(
            call_id, outcome=prefix + err.error_class, status=err.status, latency=latency, billed=billed, tokens=tokens
        )

    def tokens_today_of_others(self) -> int:
        """The model's tokens today, except this worker run's (it counts its own as they are answered)."""
        with self.pool.connection() as conn:
            return ledger.tokens_today(conn, self.model_id, excluding_run=self.worker_run)

    def provider_failure(self, breaker: BreakerFailure) -> None:
        with self.pool.connection() as conn:
            if breaker.pause_only:
                provider_state.provider_pause(
                    conn,
                    self.model_id,
                    floor=breaker.floor,
                    base=self._base,
                    cap=self._cap,
                    probe_cap=BREAKER_PROBE_INTERVAL,
                )
                return
            provider_state.provider_failure(
                conn,
                self.model_id,
                trip=breaker.trip,
                floor=breaker.floor,
                base=self._base,
                cap=self._cap,
                threshold=BREAKER_THRESHOLD,
                probe_cap=BREAKER_PROBE_INTERVAL,
            )

    def provider_healthy(self) -> None:
        """A usable answer after failures: close the breaker, reset the unusable answers in a row."""
        with self.pool.connection() as conn:
            provider_state.provider_healthy(conn, self.model_id)
            provider_state.provider_usable(conn, self.model_id)

    def provider_unusable(self, *, count: bool = True) -> int:
        """Count an answer with nothing usable to a single trivial input (``count``; every
        worker's, kept across restarts); returns how many came in a row."""
        with self.pool.connection() as conn:
            return provider_state.provider_unusable(conn, self.model_id, count=count)
