"""The worker's configuration: its threads, its timing, its budgets and its executor's.

Defaults are the named constants beside it; ``Settings.worker_config()`` builds it from the
environment (a command's options override some fields). A value out of range is an
``InvalidConfig`` naming the field, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline_assets.component_config import check
from pipeline_assets.jobqueue.executor_config import ExecutorConfig
from pipeline_assets.registry.registry_config import DEFAULT_INDEX_BUILD_MEMORY, MIN_INDEX_BUILD_MEMORY

# Provider requests in flight per worker process (`work --concurrency`).
DEFAULT_CONCURRENCY = 4
# How long a claimed job belongs to its worker before another may rescue it. Heartbeats extend it
# while a call is healthy, so it only bounds how long a dead worker's jobs stay stuck
# (`work --lease-seconds`).
DEFAULT_LEASE_SECONDS = 60.0
# How often an idle worker polls for new work, and how often it rescues expired leases and the
# claims of dead workers (one cheap UPDATE over the jobs in flight; every second, so a dead
# worker's claims wait seconds, not a lease).
IDLE_POLL_SECONDS = 0.5
RESCUE_INTERVAL_SECONDS = 1.0
# A long-running worker builds the vector index once its queue has stayed empty this long (and no
# ingest runs): a queue that empties between an ingest's batches fills again at once. A worker
# `--until-idle` builds at its drain (it is leaving).
INDEX_QUIET_SECONDS = 5.0
# Each worker refreshes its liveness row five times per window; a worker silent for a whole window
# (killed, frozen, cut off) is dead, and its claims are rescued at once instead of after their leases.
DEFAULT_WORKER_DEAD_AFTER_SECONDS = 5.0
# Token budgets: 0 is none.
NO_TOKEN_BUDGET = 0


@dataclass(frozen=True)
class WorkerConfig:
    concurrency: int = DEFAULT_CONCURRENCY
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    worker_id: str | None = None  # default: host:pid
    until_idle: bool = False
    batch_inputs: int | None = None  # default: the provider's max_batch_inputs
    poll_seconds: float = IDLE_POLL_SECONDS
    rescue_interval: float = RESCUE_INTERVAL_SECONDS
    build_index: bool = True  # build the model's HNSW index when the queue drains
    index_quiet_seconds: float = INDEX_QUIET_SECONDS  # (not `until_idle`) the queue empty this long first
    scope: tuple[int, ...] | None = None  # claim only the jobs of these documents (doc_pk); None: the whole queue
    worker_dead_after: float = DEFAULT_WORKER_DEAD_AFTER_SECONDS
    index_build_memory: int = DEFAULT_INDEX_BUILD_MEMORY  # maintenance_work_mem of its index build at most
    prepare: bool = True  # statements may be prepared server-side (False behind a transaction pooler)
    run_token_budget: int = NO_TOKEN_BUDGET  # stop claiming once this run's tokens reach it
    daily_token_budget: int = NO_TOKEN_BUDGET  # stop claiming once the model's tokens today (UTC) reach it
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    def __post_init__(self) -> None:
        check(
            self,
            [
                (self.concurrency >= 1, "concurrency", "must be at least 1"),
                (self.lease_seconds > 0, "lease_seconds", "must be positive"),
                (self.batch_inputs is None or self.batch_inputs >= 1, "batch_inputs", "must be at least 1"),
                (self.poll_seconds > 0, "poll_seconds", "must be positive"),
                (self.rescue_interval > 0, "rescue_interval", "must be positive"),
                (self.index_quiet_seconds >= 0, "index_quiet_seconds", "must not be negative"),
                (self.worker_dead_after > 0, "worker_dead_after", "must be positive"),
                (self.index_build_memory >= MIN_INDEX_BUILD_MEMORY, "index_build_memory", "must be at least 1 MiB"),
            ],
        )
