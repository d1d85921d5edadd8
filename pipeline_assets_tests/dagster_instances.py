"""Dagster instances for the tests: each on a fresh PostgreSQL database copied from one template
that holds Dagster's schema, configured as `pipeline-assets dev` configures its own (no compute
logs); and the environment and command line of Dagster's own commands."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import psycopg

from pipeline_assets.cli import dagster_instance
from pipeline_assets.store import migrations
from pipeline_assets_tests.data_helpers import write_corpus

# One migrated Dagster storage database per server and test process, copied for each instance:
# CREATE DATABASE ... TEMPLATE copies files, far quicker than Dagster creating its tables and indexes.
_TEMPLATES: dict[str, str] = {}


def _dagster_template(server_url: str) -> str:
    if server_url not in _TEMPLATES:
        name = "t_dagster_template_" + uuid.uuid4().hex[:8]
        url = migrations.ensure_database(server_url, name)
        with tempfile.TemporaryDirectory() as home, _instance_env(url):
            (Path(home) / "dagster.yaml").write_text(dagster_instance.instance_yaml())
            dg.DagsterInstance.from_config(home).dispose()  # creates (and stamps) Dagster's schema
        _TEMPLATES[server_url] = name
        atexit.register(_drop_database, server_url, name)
    return _TEMPLATES[server_url]


def _drop_database(server_url: str, name: str) -> None:
    # An embedded server may be stopped already.
    with contextlib.suppress(psycopg.Error), psycopg.connect(server_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def _instance_env(url: str) -> Iterator[None]:
    saved = os.environ.get(dagster_instance.DAGSTER_URL_ENV)
    os.environ[dagster_instance.DAGSTER_URL_ENV] = dagster_instance.sqlalchemy_url(url)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(dagster_instance.DAGSTER_URL_ENV, None)
        else:
            os.environ[dagster_instance.DAGSTER_URL_ENV] = saved


def copy_of_dagster_template(server_url: str) -> str:
    """A new database (its name) that holds Dagster's schema and nothing else; the caller drops it."""
    name = "t_dagster_" + uuid.uuid4().hex[:8]
    template = _dagster_template(server_url)
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return name


def _engines(instance: dg.DagsterInstance) -> list:
    """The SQLAlchemy engines of an instance's storages (a unified storage, ours or `storage: postgres`, wraps
    dagster-postgres' three storages in legacy adapters)."""
    found = []
    for storage in (instance.event_log_storage, instance.run_storage, instance.schedule_storage):
        inner = getattr(storage, "_storage", None)
        for candidate in (
            storage,
            getattr(inner, "event_log_storage", None),
            getattr(inner, "run_storage", None),
            getattr(inner, "schedule_storage", None),
        ):
            engine = getattr(candidate, "_engine", None)
            if engine is not None and engine not in found:
                found.append(engine)
    return found


# The in-process runs of a test capture no step output: the instance's default (local) compute-log
# manager mirrors each step's stdout and stderr through a `tail -F` and a Python watcher process
# (four processes per step, in the test's own process tree). What the tests assert is in the event
# log and the database, not in the captured output.
NO_COMPUTE_LOGS = """
compute_logs:
  module: dagster._core.storage.noop_compute_log_manager
  class: NoOpComputeLogManager
"""


@contextmanager
def postgres_instance(server_url: str) -> Iterator[dg.DagsterInstance]:
    """A Dagster instance on PostgreSQL storage (a fresh database), configured as `pipeline-assets dev`
    does but for compute logs (none).

    SQLite storage writes each event in its own transaction, too slow for range runs of many
    partitions. The fresh database is a copy of a template that holds Dagster's schema and
    nothing else.
    """
    name = copy_of_dagster_template(server_url)
    url = psycopg.conninfo.make_conninfo(server_url, dbname=name)
    with tempfile.TemporaryDirectory() as home:
        (Path(home) / "dagster.yaml").write_text(dagster_instance.instance_yaml() + NO_COMPUTE_LOGS)
        with _instance_env(url):
            instance = dg.DagsterInstance.from_config(home)
            # The storage pools its connections already (defs/pooled_storage.py); here with more
            # overflow, for the threads of a test that runs beside a run. What a run stores is
            # the same either way.
            instance.optimize_for_webserver(statement_timeout=0, pool_recycle=3600, max_overflow=20)
            try:
                yield instance
            finally:
                instance.dispose()
                for engine in _engines(instance):
                    engine.dispose()  # the pooled connections, closed before the database is dropped
                with psycopg.connect(server_url, autocommit=True) as admin:
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# Dagster's own command line, as a user runs it from the project root.
DAGSTER = [sys.executable, "-W", "ignore", "-m", "dagster"]


@contextmanager
def command_env(env: dict, tmp_path: Path) -> Iterator[tuple[dict, Path]]:
    """(environment, corpus) for Dagster's own commands: the test's settings without any DAGSTER_
    variable, a corpus of 3 documents watched by the sensors, and a Dagster storage database name
    (created by `dagster-env`/`dev` when used; dropped afterwards)."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 3)
    dagster_db = "t_dagster_" + uuid.uuid4().hex[:8]
    run_env = {k: v for k, v in env.items() if not k.startswith("DAGSTER_")}
    run_env.update({"PIPELINE_SOURCE_DIR": str(corpus), "PIPELINE_DAGSTER_DATABASE": dagster_db})
    try:
        yield run_env, corpus
    finally:
        _drop_database(env["PIPELINE_DATABASE_URL"], dagster_db)
