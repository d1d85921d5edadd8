"""What the worker's decisions (``jobqueue.decisions``, ``jobqueue.answer_checks``) return, as plain
values: ``Apply`` (transitions, with a breaker count, a pause or a stop), ``Split`` (isolate a
bad input), ``Stop`` (hand back untouched, stop the worker), ``ProbeConfig`` and
``CheckProvider`` (ask, then decide again). ``BreakerFailure`` is the provider failure every
worker shares (``JobStore.provider_failure``). The executor carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets.jobqueue.changes import Change, ClaimedJob
from pipeline_assets.providers import ProviderError


@dataclass(frozen=True)
class BreakerFailure:
    """A provider failure, shared by every worker: a throttle pauses them all
    (``pause_only``); a failure while the provider answers nobody counts
    towards tripping the breaker."""

    trip: bool  # trip at once; otherwise count towards the threshold
    floor: float  # the pause lasts at least this long (the provider's Retry-After)
    pause_only: bool = False  # a 429: every worker pauses for the floor, then claims again; nothing counted


@dataclass(frozen=True)
class Apply:
    """Apply ``changes`` (one batch); with them, the provider's and the worker's share."""

    changes: tuple[Change, ...]
    breaker: BreakerFailure | None = None  # count a provider failure (None: not the provider's)
    pause: float = 0.0  # send nothing more from this worker's held claims for this long
    unusable: bool = False  # nothing usable even to a trivial input: counts towards stopping
    stop_reason: str | None = None  # too many faults of our own in a row: stop with this one line
    charged: bool = False  # the failure points at the request's inputs, not at the provider


@dataclass(frozen=True)
class Split:
    halves: tuple[tuple[ClaimedJob, ...], tuple[ClaimedJob, ...]]


@dataclass(frozen=True)
class Stop:
    job_ids: tuple[int, ...]  # handed back untouched
    error: ProviderError  # kind FATAL: why the worker stops


@dataclass(frozen=True)
class ProbeConfig:
    """Ask the configuration probe (once per worker), then decide again."""


@dataclass(frozen=True)
class CheckProvider:
    """Ask whether the provider answers others (``ANSWERS``, ``DOWN``, ``UNUSABLE``), then decide again."""


Outcome = Apply | Split | Stop | ProbeConfig | CheckProvider
