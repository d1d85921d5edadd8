"""The queue interface the worker and the executor depend on: ``JobStore``.

Implementations: ``jobqueue.pg_job_store.PostgresJobStore`` (PostgreSQL, the
named queries of sql/queries/jobs.sql) and ``jobqueue.memory_job_store.MemoryJobStore``
(in memory, for unit tests). Both pass one contract suite
(pipeline_assets_tests/integration/test_job_store_contract.py). Every transition of a held
job is guarded by its lease owner (the fence): a holder whose lease was lost
(expired and rescued, or reclaimed by another owner) moves nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pipeline_assets.jobqueue import ledger
from pipeline_assets.jobqueue.changes import Change, ClaimedJob, JobObserver
from pipeline_assets.jobqueue.outcomes import BreakerFailure
from pipeline_assets.providers import ModelSpec, ProviderError
from pipeline_assets.providers.base import BAD_RESPONSE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """A provider answer to settle in the ledger together with the transitions it led to."""

    call_id: int
    tokens: int
    latency: float


class JobStore(Protocol):
    """One model's queue, as one worker sees it (a scope of documents, if any)."""

    @property
    def claimed(self) -> int:
        """Jobs claimed through this store (as its observers count them)."""
        ...

    def register_model(self, spec: ModelSpec) -> int | None:
        """Register the model (ModelRetired if retired); return its recorded dimension."""
        ...

    def record_dimension(self, dimension: int) -> int | None:
        """Record the dimension of the first answer; return the recorded one (the first wins)."""
        ...

    def claim(self, *, owner: str, limit: int, lease_seconds: float) -> list[ClaimedJob]:
        """Up to ``limit`` waiting jobs whose time has come, oldest ``available_at``
        first (then job id; returned in no particular order), moved to processing
        under ``owner`` for ``lease_seconds``, an attempt counted. Nothing while the breaker is tripped and
        paused or a throttle's pause lasts; once half-open, one claim takes the probe slot."""
        ...

    def apply(self, owner: str, changes: Sequence[Change], *, answer: Answer | None = None) -> dict[int, str]:
        """Apply transitions of jobs held under ``owner``, atomically; return what each
        job became (a refused job is missing). ``answer``: settle its call as billed."""
        ...

    def give_back_all(self, held: Sequence[tuple[str, list[int]]]) -> None:
        """At shutdown: every claim still held goes back without using an attempt."""
        ...

    def release_probe(self, owner: str) -> None:
        """Free the half-open probe slot if ``owner`` holds it."""
        ...

    def outstanding(self) -> bool:
        """Whether the model has jobs waiting or under a lease."""
        ...

    def ingest_running(self) -> bool:
        """Whether an ingest is running now (a drained worker puts off its index build)."""
        ...

    def rescue(self, rescuer: str | None = None) -> int:
        """Return expired leases (and a dead worker's claims) to the queue, attempt
        given back and a fault counted; returns how many were rescued."""
        ...

    def extend_leases(self, held: Sequence[tuple[str, list[int]]], lease_seconds: float) -> None:
        """Push the leases of jobs still held by each owner ``lease_seconds`` ahead."""
        ...

    def record_send(self, jobs: Sequence[ClaimedJob], tokens: int) -> int:
        """Count a send before its request goes out (possibly billed); returns the call id."""
        ...

    def record_outcome(
        self, call_id: int, *, outcome: str, status: int | None, latency: float, billed: str, tokens: int | None = None
    ) -> None:
        """Settle a recorded send once (a second outcome changes nothing)."""
        ...

    def record_failure(self, call_id: int, err: ProviderError, latency: float, prefix: str = "") -> None:
        """Settle a failed send (``failure_billing``)."""
        ...

    def tokens_today_of_others(self) -> int:
        """The model's tokens today, except this worker run's."""
        ...

    def provider_failure(self, breaker: BreakerFailure) -> None:
        """Count a provider failure for every worker (pause, or trip the breaker)."""
        ...

    def provider_healthy(self) -> None:
        """A usable answer: close the breaker, reset the unusable answers in a row."""
        ...

    def provider_unusable(self, *, count: bool = True) -> int:
        """Count (``count``) an unusable answer to a trivial input; return how many in a row."""
        ...


def failure_billing(err: ProviderError) -> tuple[str, int | None]:
    """(billed, tokens) of a failed send: an ambiguous failure (timeout, dropped or
    unmatchable answer) may have been billed and keeps its estimate (None); a refusal was not."""
    maybe = err.billed_maybe or err.error_class == BAD_RESPONSE
    return (ledger.MAYBE_BILLED, None) if maybe else (ledger.NOT_BILLED, 0)


def tell(observers: Sequence[JobObserver], event: str, *args: object) -> None:
    """Tell each observer ``event``; an observer's error is logged, never raised."""
    for observer in observers:
        try:
            getattr(observer, event)(*args)
        except Exception:  # an observer must never fail a transition that already committed
            log.exception("job observer %s failed", type(observer).__name__)
