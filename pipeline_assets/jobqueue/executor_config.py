"""The executor's configuration: how one claim's provider calls are bounded and retried.

Defaults are the named constants beside it; ``Settings.executor_config()`` builds it from the
environment. A value out of range is an ``InvalidConfig`` naming the field, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline_assets.component_config import check

# Wall-clock limit of one provider request: a stalled call becomes an ordinary retryable failure.
DEFAULT_CALL_TIMEOUT_SECONDS = 60.0
# Full-jitter backoff of a failed job: uniform(0, min(cap, base * 2^attempt)).
DEFAULT_BACKOFF_BASE_SECONDS = 1.0
DEFAULT_BACKOFF_CAP_SECONDS = 60.0
# The longest pause a provider's Retry-After may impose (a proxy's `Retry-After: 86400` would
# otherwise pause every worker for a day).
DEFAULT_RETRY_AFTER_CAP_SECONDS = 300.0
# 429s one input may meet; one more while alone in its request dead-letters it: a throttle uses no
# attempt, so without a cap a request the provider never accepts would stall the model forever.
DEFAULT_MAX_THROTTLES = 10


@dataclass(frozen=True)
class ExecutorConfig:
    call_timeout: float = DEFAULT_CALL_TIMEOUT_SECONDS
    backoff_base: float = DEFAULT_BACKOFF_BASE_SECONDS
    backoff_cap: float = DEFAULT_BACKOFF_CAP_SECONDS
    retry_after_cap: float = DEFAULT_RETRY_AFTER_CAP_SECONDS
    max_throttles: int = DEFAULT_MAX_THROTTLES
    crashpoint: str | None = None  # tests only: freeze at a named point (``jobqueue.crashpoints``)

    def __post_init__(self) -> None:
        check(
            self,
            [
                (self.call_timeout > 0, "call_timeout", "must be positive"),
                (self.backoff_base >= 0, "backoff_base", "must not be negative"),
                (self.backoff_cap >= 0, "backoff_cap", "must not be negative"),
                (self.retry_after_cap >= 0, "retry_after_cap", "must not be negative"),
                (self.max_throttles >= 1, "max_throttles", "must be at least 1"),
            ],
        )
