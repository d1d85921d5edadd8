"""Shared fixtures: a real PostgreSQL (embedded, or PIPELINE_DATABASE_URL's server), a fresh
database per test module, the fake OpenAI server and the environment that points the CLI at them;
the session's end checks that no process it started is left (``processes.py``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import psycopg
import pytest

from pipeline_assets.cli.dagster_instance import RUN_EVENT_SETTINGS
from pipeline_assets.store import db, embedded_postgres
from pipeline_assets_tests.fake_openai import FakeOpenAI
from pipeline_assets_tests.processes import leftover_processes, wait_until

FAKE_MODEL = "fake-embed"  # unknown to the provider table: dimension discovered from the first response
# ...and window not known either: a server's model is refused without PIPELINE_MODEL_MAX_INPUT_TOKENS.
# The fake server cuts nothing; this is the window every environment the suite builds gives it.
FAKE_WINDOW = 8191
FAKE_DIM = 16
# PIPELINE_TEST_PROFILE=long: the long profiles of the slow tests (a longer fault soak, more
# hypothesis examples, the 1,000-document dev-server corpus). Unset: the short ones `pytest -q` runs.
LONG_PROFILE = os.environ.get("PIPELINE_TEST_PROFILE") == "long"
# The partition buckets of the in-process Dagster modules and the dev-server module: what they test
# holds for any count, and Dagster's bookkeeping per partition (events, staleness) costs in proportion
# to it. `dagster dev`'s module and the topology run the product's 64 (the UI path at the default), and
# so does the dev-server module's long profile.
TEST_BUCKETS = 10

# The runs a test executes in-process write their events as `pipeline-assets dev`'s runs do (one
# planned event per asset and range, events written in batches), not one row at a time.
for _name, _value in RUN_EVENT_SETTINGS.items():
    os.environ.setdefault(_name, _value)
# The suite keeps bytecode caches even where PYTHONDONTWRITEBYTECODE is set (it is on this project's
# machines): otherwise each xdist process rewrites the assertions of every test module again at
# collection and each interpreter the suite starts compiles again what the last one compiled. The
# caches go where Python puts them (__pycache__, ignored by git); this process and every one it starts
# keep them.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


@pytest.fixture(scope="session", autouse=True)
def no_process_survives():
    """Session end: no process started (directly or not) by this test process is left: a `dagster
    dev` code server or gRPC child that outlived it, a run's compute-log `tail -F`, a CLI process.
    Requested first, so checked after every other teardown; what is left is killed, then reported."""
    yield
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not leftover_processes(), timeout=30, what="the processes of the tests to exit")
    left = leftover_processes()
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()  # do not leak them past the failure either
    assert not left, "processes outlived the tests: " + "; ".join(
        f"{p.pid} " + " ".join(p.info["cmdline"] or [])[:160] for p in left
    )


# The slowest modules, slowest first (each module's summed test time in a whole run). With
# `--dist loadfile` a worker takes the next module in collection order when it is nearly out of
# work, so the longest start first and the short ones fill in around them (longest processing time
# first): a long module collected late would otherwise run alone at the end.
SLOW_MODULES = [
    "test_dagster_webserver",
    "test_dagster_sensors",
    "test_topology",
    "test_dagster_assets",
    "test_local_model",
    "test_crash_attribution",
    "test_topology_scale",
    "test_topology_faults",
    "test_stage_timeout",
    "test_provider_evidence",
    "test_dagster_commands",
    "test_dagster_dev_command",
    "test_s3_source",
    "test_cli",
    "test_state_machine_property",
    "test_contract",
    "test_embedded",
    "test_dagster_table_source",
    "test_provider_faults",
    "test_dagster_sync_and_embed",
    "test_state_machine",
    "test_packaging",
    "test_vector_index",
    "test_dagster_model_switch",
    "test_call_deadline",
    "test_third_party_server",
    "test_leases",
    "test_dagster_reconcile",
    "test_fault_soak",
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))  # stable


@pytest.fixture(scope="session")
def server_url(tmp_path_factory) -> str:
    """The PostgreSQL server the suite creates its databases on."""
    url = os.environ.get("PIPELINE_TEST_SERVER_URL") or os.environ.get("PIPELINE_DATABASE_URL")
    if url:
        yield url  # a server the suite does not own: nothing to stop
        return
    if os.environ.get("PIPELINE_TEST_HOME"):
        yield without_flushes(embedded_postgres.ensure_server(Path(os.environ["PIPELINE_TEST_HOME"])))
        return
    home = server_home("pipeline-tests-pg-")
    yield without_flushes(embedded_postgres.ensure_server(home))
    embedded_postgres.stop_server(home)  # a server this session started does not outlive it
    shutil.rmtree(home, ignore_errors=True)


def without_flushes(url: str) -> str:
    """The tests' own server writes without flushing to disk (``fsync``, ``full_page_writes`` off,
    as the topology's server): the suite commits many thousands of times (Dagster's event storage, the
    job table), and a flush each costs more CPU and wall time than the commit (docs/benchmarks.md). A commit
    still survives a killed process, the server's included (the kernel keeps what was written); only
    a crash of the machine itself could lose one, and the suite's databases are scratch."""
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET fsync = off")
        admin.execute("ALTER SYSTEM SET full_page_writes = off")
        admin.execute("SELECT pg_reload_conf()")
    return url


def server_home(prefix: str) -> Path:
    """A fresh directory for an embedded server's data, outside pytest's temporary root: as root the
    server runs as another user, and each new pytest session takes that user's access to pytest's
    root away again (mode 0o700), which stopped the servers of a session already running beside it."""
    return Path(tempfile.mkdtemp(prefix=prefix)).resolve()


def _with_dbname(url: str, name: str) -> str:
    return psycopg.conninfo.make_conninfo(url, dbname=name)


@pytest.fixture(scope="session")
def migrated_template(server_url) -> str:
    """A database with every migration applied and nothing else, which module databases copy."""
    name = "t_template_" + uuid.uuid4().hex[:8]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    with db.session(_with_dbname(server_url, name)):
        pass
    yield name
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def database_url(server_url, migrated_template, request) -> str:
    """A fresh, migrated database for this test module (a copy of the migrated template)."""
    name = "t_" + re.sub(r"\W", "_", request.module.__name__.split(".")[-1])[:40] + "_" + uuid.uuid4().hex[:6]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{migrated_template}"')
    url = _with_dbname(server_url, name)
    with db.session(url):  # up to date: applies nothing
        pass
    yield url
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def conn(database_url):
    c = db.connect(database_url)
    db.migrate(c)
    yield c
    c.close()


@pytest.fixture
def clean_db(conn):
    """Empty every table (same schema) so a test starts from nothing."""
    conn.execute("""TRUNCATE app.sources, app.documents, app.chunks, app.embedding_jobs, app.job_keys, app.embeddings,
                    app.stage_runs, app.provider_state, app.provider_calls, app.input_sends_until_032,
                    app.models, app.source_observations, app.partition_scheme, app.running_ingests CASCADE""")
    return conn


@pytest.fixture
def fake():
    with FakeOpenAI(dim=FAKE_DIM) as srv:
        yield srv


@pytest.fixture
def env(database_url, fake, tmp_path, monkeypatch):
    """Environment for in-process calls and CLI subprocesses: fake provider, test database, fast backoff."""
    values = {
        "PIPELINE_DATABASE_URL": database_url,
        "OPENAI_API_KEY": "test-key",
        "OPENAI_BASE_URL": fake.base_url,
        "PIPELINE_EMBEDDING_MODEL": FAKE_MODEL,
        "PIPELINE_MODEL_MAX_INPUT_TOKENS": str(FAKE_WINDOW),
        "PIPELINE_BACKOFF_BASE": "0.05",
        "PIPELINE_BACKOFF_CAP": "0.2",
        "PIPELINE_CALL_TIMEOUT": "5",
        "PIPELINE_HOME": str(tmp_path / "home"),
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PIPELINE_CRASHPOINT", raising=False)
    full = dict(os.environ)
    return full
