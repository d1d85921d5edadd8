"""What a Dagster instance of ours is configured with: its dagster.yaml (storage in PostgreSQL
through dagster-postgres, whose URL is read from ``DAGSTER_PG_URL`` at start: no password on
disk; then the settings every instance shares), that storage URL in SQLAlchemy's
``postgresql+psycopg2://`` form (dagster-postgres fails on psycopg 3), and the run-event
settings of the processes that create and execute runs. No Dagster import.
"""

from pathlib import Path

import psycopg

DAGSTER_URL_ENV = "DAGSTER_PG_URL"
REPO = Path(__file__).resolve().parents[2]

# Dagster settings read from the environment by the processes that create runs
# (webserver, daemon) and execute them. A single-run backfill of N partitions
# otherwise writes 3N "planned" events and 3N materializations one row (and,
# with dagster-postgres' NullPool, one connection) at a time; these batch them
# (B10's backfills run with them, docs/benchmarks.md). The cost: Dagster no longer marks the
# partitions of a FAILED range run as failed in its UI (the run shows failed; the
# per-item state lives in app.stage_runs and the job table, as designed).
RUN_EVENT_SETTINGS = {
    "DAGSTER_EVENT_BATCH_SIZE": "1000",
    "DAGSTER_EMIT_PARTITION_SUBSET_IN_PLANNED_EVENTS": "true",
}

# What holds for every instance (run queue, pools, monitoring, retention,
# telemetry): the repository's top-level dagster.yaml, which `dagster dev` from
# the root reads too. An installed wheel without the checkout around it uses
# this copy (test_dagster_definitions keeps the two equal).
INSTANCE_SETTINGS_FILE = REPO / "dagster.yaml"
# The storage class (a module the Dagster processes import; this one does not).
POOLED_STORAGE_MODULE, POOLED_STORAGE_CLASS = "pipeline_assets.defs.pooled_storage", "PooledPostgresStorage"
STORAGE_YAML = f"""\
# Written by `pipeline-assets dev` at every start; edits here are overwritten.
# Storage (runs, event log, schedules) in PostgreSQL through dagster-postgres, each
# process holding its connections in a pool (pipeline_assets/defs/pooled_storage.py);
# the URL (postgresql+psycopg2://...) comes from ${DAGSTER_URL_ENV}.
storage:
  custom:
    module: {POOLED_STORAGE_MODULE}
    class: {POOLED_STORAGE_CLASS}
    config:
      postgres_url:
        env: {DAGSTER_URL_ENV}
"""
INSTANCE_SETTINGS = """\
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    dequeue_interval_seconds: 1
concurrency:
  runs:
    max_concurrent_runs: 4
  pools:
    default_limit: 1
    granularity: op
sensors:
  use_threads: true
  num_workers: 4
run_monitoring:
  enabled: true
  start_timeout_seconds: 180
  poll_interval_seconds: 60
retention:
  schedule:
    purge_after_days: 30
  sensor:
    purge_after_days:
      skipped: 7
      failure: 30
      success: -1
telemetry:
  enabled: false
"""


def instance_yaml() -> str:
    """The dagster.yaml `pipeline-assets dev` writes: storage, then the shared settings."""
    shared = INSTANCE_SETTINGS_FILE.read_text() if INSTANCE_SETTINGS_FILE.is_file() else INSTANCE_SETTINGS
    return STORAGE_YAML + "\n" + shared


def sqlalchemy_url(libpq_url: str) -> str:
    """A libpq URL/DSN as a SQLAlchemy psycopg2 URL (a unix-socket host goes into ``?host=``)."""
    from sqlalchemy.engine import URL

    params = {k: str(v) for k, v in psycopg.conninfo.conninfo_to_dict(libpq_url).items()}
    host = params.pop("host", None)
    query = {k: v for k, v in params.items() if k not in ("user", "password", "port", "dbname")}
    tcp_host = host
    if host and (host.startswith("/") or "," in host):
        query["host"] = host
        tcp_host = None
    url = URL.create(
        "postgresql+psycopg2",
        username=params.get("user") or None,
        password=params.get("password") or None,
        host=tcp_host,
        port=int(params["port"]) if params.get("port") else None,
        database=params.get("dbname"),
        query=query,
    )
    return url.render_as_string(hide_password=False)
