"""Every tunable default in one place: a named constant, what it bounds, and the
environment variable that overrides it."""

from __future__ import annotations

import os
from pathlib import Path

# Where the embedded PostgreSQL keeps its data when PIPELINE_DATABASE_URL is unset.
DEFAULT_HOME = "./.pipeline"

# How long a claimed job belongs to its worker before another may rescue it.
# Heartbeats extend it while a call is healthy, so it only bounds how long a
# dead worker's jobs stay stuck.
DEFAULT_LEASE_SECONDS = 60.0

# Wall-clock limit of one provider request; a stalled call becomes an ordinary
# retryable failure instead of holding a worker (and its lease) forever.
DEFAULT_CALL_TIMEOUT_SECONDS = 60.0

# Attempts per job before it is dead-lettered (status 'failed').
DEFAULT_MAX_ATTEMPTS = 5

# Full-jitter backoff: delay = uniform(0, min(cap, base * 2**attempt)).
DEFAULT_BACKOFF_BASE_SECONDS = 1.0
DEFAULT_BACKOFF_CAP_SECONDS = 60.0

# Inputs per provider request (OpenAI allows 2048) and tokens per request.
DEFAULT_BATCH_INPUTS = 256
MAX_BATCH_INPUTS = 2048
DEFAULT_BATCH_TOKENS = 100_000

# Provider requests in flight per worker process.
DEFAULT_CONCURRENCY = 4

# How often an idle worker polls for new work, and how often it rescues
# expired leases of dead workers.
IDLE_POLL_SECONDS = 0.5
RESCUE_INTERVAL_SECONDS = 5.0

# Consecutive provider failures (5xx, timeouts, connection errors) that trip
# the shared circuit breaker; a 429 trips it at once.
BREAKER_THRESHOLD = 5

# Optional token budgets (0 = none): a worker stops claiming, leaving jobs
# pending, once the model's tokens today (UTC) or this run reach them.
DEFAULT_DAILY_TOKEN_BUDGET = 0
DEFAULT_RUN_TOKEN_BUDGET = 0

# Wall-clock limit of extracting and chunking one document; a pathological
# file is quarantined with error class 'timeout' instead of stalling ingest.
DEFAULT_STAGE_TIMEOUT_SECONDS = 60.0

# Documents written per ingest transaction.
INGEST_BATCH_DOCUMENTS = 200

# How much of a provider error message is kept in the database.
ERROR_MESSAGE_MAX_CHARS = 500


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw not in (None, "") else default


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else default


def pipeline_home() -> Path:
    return Path(os.environ.get("PIPELINE_HOME") or DEFAULT_HOME).expanduser().resolve()


def database_url_from_env() -> str | None:
    return os.environ.get("PIPELINE_DATABASE_URL") or None


def backoff_base() -> float:
    return env_float("PIPELINE_BACKOFF_BASE", DEFAULT_BACKOFF_BASE_SECONDS)


def backoff_cap() -> float:
    return env_float("PIPELINE_BACKOFF_CAP", DEFAULT_BACKOFF_CAP_SECONDS)


def max_attempts() -> int:
    return env_int("PIPELINE_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS)


def call_timeout() -> float:
    return env_float("PIPELINE_CALL_TIMEOUT", DEFAULT_CALL_TIMEOUT_SECONDS)
