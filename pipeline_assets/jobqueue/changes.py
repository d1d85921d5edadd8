"""The transitions of held jobs, as plain values (no database here).

The worker's pure decisions (``jobqueue.decisions``) return these; ``transitions.apply`` (through
``JobStore.apply``) applies a batch under a lease owner, one guarded statement per kind (its
named query in sql/queries/jobs.sql, named on each class), and returns what each job became.
Complete: processing -> ready, or superseded when the content is no longer wanted.
Retry: -> retry, the attempt used (failed when used up). GiveBack: -> pending|retry, the
attempt returned. Fail: -> failed at once. Supersede: -> superseded. Isolate: alone next time.
Each field is the named parameter of the same name in the query; a tuple field holds one
value per job (``job_ids`` order), any other field is the same for every job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


class ClaimedJob(NamedTuple):
    """A job a claim took: a row of jobs.sql claim, whose columns are these fields
    in this order. A named tuple rather than a frozen dataclass: a claim builds
    one per job, and a frozen dataclass's __init__ (an object.__setattr__ per
    field) cost about ten times as much."""

    job_id: int
    chunk_checksum: bytes
    attempts: int
    max_attempts: int
    text: str | None  # None: no current chunk carries the checksum any more
    token_count: int | None = None
    probe: bool = False  # this claim is the half-open breaker's probe
    throttles: int = 0  # 429s this job met (they use no attempt; past a cap a lone input fails)
    isolate: bool = False  # it was in a batch refused for a bad input: send it alone
    faults: int = 0  # transient faults charged to its requests, not to it (its requests shrink with them)
    crashed: bool = False  # its last failure was a crash of the worker holding it (jobs.sql rescue_expired)


@dataclass(frozen=True)
class Complete:  # jobs.sql: complete
    job_ids: tuple[int, ...]
    vectors: tuple[Any, ...]  # per job: its vector (float32)
    # The provider call whose answer these vectors are, settled (answered, billed)
    # by the same statement; None: settle nothing (the caller settles it, or no call).
    call: int | None = None
    tokens: int | None = None  # the call's tokens (the provider's usage); None keeps the estimate
    latency_ms: int = 0  # the call's latency


@dataclass(frozen=True)
class Retry:  # jobs.sql: fail_retryable
    job_ids: tuple[int, ...]
    delays: tuple[float, ...]  # per job: seconds before it is claimable again
    error_class: str
    message: str


@dataclass(frozen=True)
class GiveBack:  # jobs.sql: give_back
    job_ids: tuple[int, ...]
    delay: float = 0.0  # not claimable again before this
    error_class: str | None = None  # None: keep the job's last error
    message: str | None = None
    throttled: bool = False  # count a throttle on each job
    faulted: bool = False  # count a transient fault charged to the request on each job


@dataclass(frozen=True)
class Fail:  # jobs.sql: fail_terminal
    job_ids: tuple[int, ...]
    error_class: str
    message: str


@dataclass(frozen=True)
class Supersede:  # jobs.sql: supersede_held
    job_ids: tuple[int, ...]


@dataclass(frozen=True)
class Isolate:  # jobs.sql: mark_isolated
    job_ids: tuple[int, ...]


Change = Complete | Retry | GiveBack | Fail | Supersede | Isolate


def merged(changes: Sequence[Change]) -> list[Change]:
    """The changes of a batch with the same kind and the same shared fields
    joined into one (per-job fields concatenated): one statement each. Empty
    changes are left out; order of first appearance is kept."""
    groups: dict[tuple, list[Change]] = {}
    for change in changes:
        if change.job_ids:
            groups.setdefault(_shared(change), []).append(change)
    out: list[Change] = []
    for members in groups.values():
        if len(members) == 1:
            out.append(members[0])
            continue
        first = members[0]
        per_job = {
            f.name: tuple(v for m in members for v in getattr(m, f.name))
            for f in dataclasses.fields(first)
            if isinstance(getattr(first, f.name), tuple)
        }
        # (mypy cannot type replace() over a union of dataclasses with computed field names)
        out.append(dataclasses.replace(first, **per_job))  # type: ignore[arg-type]
    return out


def params(change: Change) -> dict[str, Any]:
    """The named parameters of a change's query (lists for the per-job fields)."""
    return {
        f.name: list(v) if isinstance(v := getattr(change, f.name), tuple) else v for f in dataclasses.fields(change)
    }


def _shared(change: Change) -> tuple:
    return (
        type(change),
        *(
            getattr(change, f.name)
            for f in dataclasses.fields(change)
            if not isinstance(getattr(change, f.name), tuple)
        ),
    )


class JobObserver:
    """Something that watches what the queue did (a log, metrics, a report):
    called after the statement committed; it must not raise into the worker.
    Every method does nothing unless overridden."""

    def claimed(self, jobs: Sequence[ClaimedJob]) -> None:
        """A claim took ``jobs``."""

    def applied(self, change: Change, became: dict[int, str]) -> None:
        """``change`` was applied; ``became``: what its jobs became (refused ones are missing)."""

    def rescued(self, count: int) -> None:
        """``count`` expired or orphaned leases were rescued."""
