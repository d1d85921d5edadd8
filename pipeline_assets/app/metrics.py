"""Prometheus metrics of a `work` process (`work --metrics-port P`).

On the worker's hot path only a few counter increments per provider call (``ObservedProvider``
wraps the provider); everything else is read at scrape time: the worker's own counters, and from
the database, with a short cache, the jobs by status and the breaker (``status``'s named queries).
Every name is prefixed ``pipeline_``; the list and their meaning: docs/operations.md, metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from psycopg_pool import ConnectionPool, PoolTimeout

from pipeline_assets.jobqueue.status import JobStatus
from pipeline_assets.jobqueue.worker import Worker
from pipeline_assets.providers import EmbedResult, Provider, ProviderError
from pipeline_assets.store import reports

log = logging.getLogger(__name__)


# How long a scrape reuses the jobs-by-status and breaker rows it read: bounds
# the queries scrapers add to the database to one pair per this many seconds.
DB_CACHE_SECONDS = 1.0

# How long a scrape waits for a pooled connection before repeating the last values.
DB_TIMEOUT_SECONDS = 2.0

# Provider latency buckets (seconds): from a local fake to a call near its deadline.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

BREAKER_STATES = ("closed", "open", "half-open")
OUTCOMES = ("embedded", "superseded", "failed", "retried", "throttled", "refused")


class ProviderMetrics:
    """Counters of the provider calls of this process."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pipeline_provider_requests",
            "Provider requests by HTTP status (or error class when there was no answer).",
            ["status"],
            registry=registry,
        )
        self.throttled = Counter("pipeline_provider_throttled", "Provider requests answered 429.", registry=registry)
        self.latency = Histogram(
            "pipeline_provider_latency_seconds",
            "Wall-clock time of a provider call.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inputs = Counter("pipeline_provider_inputs", "Inputs sent to the provider.", registry=registry)
        self.tokens = Counter(
            "pipeline_provider_tokens", "Tokens the provider reported for answered calls.", registry=registry
        )

    def on_call(self, latency: float, status: str, inputs: int, tokens: int) -> None:
        self.requests.labels(status).inc()
        if status == "429":
            self.throttled.inc()
        self.latency.observe(latency)
        self.inputs.inc(inputs)
        if tokens:
            self.tokens.inc(tokens)


class ObservedProvider:
    """The provider a worker calls, with each call's latency, status, inputs and tokens counted."""

    def __init__(self, inner: Provider, on_call: Callable[[float, str, int, int], None]) -> None:
        self._inner = inner
        self._on_call = on_call
        self.spec = inner.spec

    def embed(self, texts: Sequence[str]) -> EmbedResult:
        started = time.monotonic()
        try:
            result = self._inner.embed(texts)
        except ProviderError as err:
            self._on_call(time.monotonic() - started, str(err.status or err.error_class), len(texts), 0)
            raise
        self._on_call(time.monotonic() - started, "200", len(texts), result.tokens)
        return result

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else the worker or runtime asks of the provider
        return getattr(self._inner, name)


class WorkerCollector:
    """The worker's own counters, read at scrape time (nothing is pushed from its loop)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def collect(self) -> Iterator[Metric]:
        worker = self.worker
        report = worker.report if worker is not None else None
        store = worker.store if worker is not None else None
        claimed = CounterMetricFamily("pipeline_jobs_claimed", "Jobs this process claimed.")
        claimed.add_metric([], getattr(store, "claimed", 0))
        outcomes = CounterMetricFamily("pipeline_worker_jobs", "Outcomes of this process's claims.", labels=["outcome"])
        for outcome in OUTCOMES:
            outcomes.add_metric([outcome], getattr(report, outcome, 0))
        rescues = CounterMetricFamily(
            "pipeline_lease_rescues", "Jobs this process rescued from expired leases or dead workers."
        )
        rescues.add_metric([], getattr(report, "rescued", 0))
        superseded = CounterMetricFamily(
            "pipeline_superseded_results", "Claimed jobs whose content was no longer wanted (results not stored)."
        )
        superseded.add_metric([], getattr(report, "superseded", 0))
        info = GaugeMetricFamily(
            "pipeline_worker_info", "This process's worker id and model (always 1).", labels=["worker_id", "model"]
        )
        if worker is not None:
            info.add_metric([worker.worker_id, worker.model_id], 1.0)
        yield from (claimed, outcomes, rescues, superseded, info)


class DatabaseCollector:
    """Jobs by status and the breaker, read from the database at scrape time, cached briefly."""

    def __init__(self, pool: ConnectionPool, cache_seconds: float = DB_CACHE_SECONDS) -> None:
        self._pool = pool
        self._cache_seconds = cache_seconds
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._rows: tuple[list, list] = ([], [])
        self.errors = 0  # scrapes that found the database unreachable

    def _read(self) -> tuple[list, list]:
        """The cached rows, re-read when older than the cache; the last ones (and an error
        counted) when the database does not answer: a scrape never fails or hangs on it."""
        with self._lock:
            if time.monotonic() - self._read_at >= self._cache_seconds:
                try:
                    with self._pool.connection(timeout=DB_TIMEOUT_SECONDS) as conn:
                        jobs = reports.job_rows(conn)
                        breaker = reports.breaker_rows(conn)
                    self._rows, self._read_at = (jobs, breaker), time.monotonic()
                except (psycopg.Error, PoolTimeout) as exc:
                    self.errors += 1
                    log.warning("metrics: could not read the job counts: %s", type(exc).__name__)
            return self._rows

    def collect(self) -> Iterator[Metric]:
        jobs_rows, breaker_rows = self._read()
        jobs = GaugeMetricFamily(
            "pipeline_jobs", "Jobs by model and status (every worker's), from the database.", labels=["model", "status"]
        )
        for model_id, status, n in jobs_rows:
            jobs.add_metric([model_id, status], n)
        state = GaugeMetricFamily(
            "pipeline_breaker_state",
            "The provider's circuit breaker per model: 1 for its current state.",
            labels=["model", "state"],
        )
        paused = GaugeMetricFamily(
            "pipeline_breaker_paused_seconds", "Seconds left in an open breaker's pause.", labels=["model"]
        )
        for model_id, current, paused_for, *_ in breaker_rows:
            for s in BREAKER_STATES:
                state.add_metric([model_id, s], 1.0 if s == current else 0.0)
            paused.add_metric([model_id], paused_for)
        errors = CounterMetricFamily(
            "pipeline_metrics_database_errors",
            "Scrapes that could not read the database (the gauges then repeat the last values read).",
        )
        errors.add_metric([], self.errors)
        yield from (jobs, state, paused, errors)


class WorkMetrics:
    """One `work` process's registry: provider counters, the worker's counters, the database's gauges."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.registry = CollectorRegistry()
        self.provider = ProviderMetrics(self.registry)
        self.worker = WorkerCollector()
        self.registry.register(self.worker)
        self.registry.register(DatabaseCollector(pool))

    def wrap(self, provider: Provider) -> ObservedProvider:
        return ObservedProvider(provider, self.provider.on_call)

    def observe(self, worker: Worker) -> None:
        self.worker.worker = worker

    def serve(self, port: int, host: str = "127.0.0.1") -> tuple[str, int]:
        """Expose /metrics over HTTP in a daemon thread; returns the address bound (port 0: any free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        bound_host, bound_port = server.server_address[:2]
        return str(bound_host), int(bound_port)


def outstanding_jobs(pool: ConnectionPool, model_id: str) -> int:
    """The model's jobs not yet ready, failed or superseded (pending, retry, processing): a progress bar's total."""
    with pool.connection() as conn:
        rows = reports.job_rows(conn)
    waiting = (JobStatus.PENDING, JobStatus.RETRY, JobStatus.PROCESSING)
    return sum(n for model, status, n in rows if model == model_id and status in waiting)
