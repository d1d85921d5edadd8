"""The queue's variables: the worker's liveness, the executor's backoff and throttles, the token
budgets, the model registry's bounds (``executor_config()`` and ``worker_config()`` are built by
``Settings``, with the provider's call timeout)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets.jobqueue.executor_config import (
    DEFAULT_BACKOFF_BASE_SECONDS,
    DEFAULT_BACKOFF_CAP_SECONDS,
    DEFAULT_MAX_THROTTLES,
    DEFAULT_RETRY_AFTER_CAP_SECONDS,
)
from pipeline_assets.jobqueue.worker_config import DEFAULT_WORKER_DEAD_AFTER_SECONDS, NO_TOKEN_BUDGET
from pipeline_assets.registry.registry_config import DEFAULT_INDEX_BUILD_MEMORY, DEFAULT_MODEL_RETIRE_GRACE_SECONDS
from pipeline_assets.settings.reading import setting


@dataclass(frozen=True)
class QueueSettings:
    worker_dead_after: float = setting(
        "PIPELINE_WORKER_DEAD_AFTER",
        DEFAULT_WORKER_DEAD_AFTER_SECONDS,
        "a worker silent this long is dead; its claims are rescued (s)",
    )
    backoff_base: float = setting(
        "PIPELINE_BACKOFF_BASE",
        DEFAULT_BACKOFF_BASE_SECONDS,
        "full-jitter backoff `uniform(0, min(cap, base·2^attempt))`: base (s)",
    )
    backoff_cap: float = setting("PIPELINE_BACKOFF_CAP", DEFAULT_BACKOFF_CAP_SECONDS, "full-jitter backoff: cap (s)")
    retry_after_cap: float = setting(
        "PIPELINE_RETRY_AFTER_CAP",
        DEFAULT_RETRY_AFTER_CAP_SECONDS,
        "longest pause a provider's Retry-After may impose (s)",
    )
    max_throttles: int = setting(
        "PIPELINE_MAX_THROTTLES",
        DEFAULT_MAX_THROTTLES,
        "429s one input may meet; one more while alone in its request dead-letters it (`throttled_too_often`)",
    )
    daily_token_budget: int = setting(
        "PIPELINE_DAILY_TOKEN_BUDGET",
        NO_TOKEN_BUDGET,
        "stop claiming once the model's tokens today (UTC) reach it; 0 = none",
    )
    run_token_budget: int = setting(
        "PIPELINE_RUN_TOKEN_BUDGET", NO_TOKEN_BUDGET, "stop claiming once this run's tokens reach it; 0 = none"
    )
    model_retire_grace: float = setting(
        "PIPELINE_MODEL_RETIRE_GRACE",
        DEFAULT_MODEL_RETIRE_GRACE_SECONDS,
        "a retired model's vectors and index are deleted by reconcile this long after `models retire` (s)",
        shown_default="7 days",
    )
    index_build_memory: int = setting(
        "PIPELINE_INDEX_BUILD_MEMORY",
        DEFAULT_INDEX_BUILD_MEMORY,
        "most `maintenance_work_mem` of a vector index build, in bytes (sized to "
        "the HNSW graph, never below the server's)",
        shown_default="2 GiB",
    )
    crashpoint: str | None = setting(
        "PIPELINE_CRASHPOINT", None, "tests only: freeze the worker at a named point to be killed"
    )
