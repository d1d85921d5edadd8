"""Shared fixtures: a real PostgreSQL (embedded, or PIPELINE_DATABASE_URL's
server), a fresh database per test module, the fake OpenAI server, corpora,
and helpers that run the real CLI in real processes."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import psycopg
import pytest

from pipeline_assets.cli.dagster_instance import RUN_EVENT_SETTINGS
from pipeline_assets.store import db, embedded_postgres
from pipeline_assets_tests.fake_openai import FakeOpenAI

REPO = Path(__file__).resolve().parent.parent
FAKE_MODEL = "fake-embed"  # unknown to the provider table: dimension discovered from the first response
# ...and window not known either: a server's model is refused without PIPELINE_MODEL_MAX_INPUT_TOKENS.
# The fake server cuts nothing; this is the window every environment the suite builds gives it.
FAKE_WINDOW = 8191
FAKE_DIM = 16
# PIPELINE_TEST_PROFILE=long: the long profiles of the slow tests (a longer fault soak, more
# hypothesis examples, the 1,000-document dev-server corpus). Unset: the short ones `pytest -q` runs.
LONG_PROFILE = os.environ.get("PIPELINE_TEST_PROFILE") == "long"

# Every process this test process starts inherits this marker (one value per xdist worker), so what
# the suite started can be found at the end even after it was re-parented or left its session. Not
# PIPELINE_-prefixed: the tests that build a clean environment drop those, and must keep this one.
SESSION_MARKER = "PYTEST_PIPELINE_SESSION"
os.environ[SESSION_MARKER] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
# The runs a test executes in-process write their events as `pipeline-assets dev`'s runs do (one
# planned event per asset and range, events written in batches): a 64-bucket run's events otherwise
# took about a third of each Dagster test.
for _name, _value in RUN_EVENT_SETTINGS.items():
    os.environ.setdefault(_name, _value)
# The suite keeps bytecode caches even where PYTHONDONTWRITEBYTECODE is set (it is on this project's
# machines): otherwise each xdist process rewrites the assertions of every test module again at
# collection (~6 CPU-s each) and each interpreter the suite starts compiles again what the last one
# compiled. Measured quiet, the whole suite: 6:07 without the caches, 5:31 with them. The caches go
# where Python puts them (__pycache__, ignored by git); this process and every one it starts keep them.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def marked_processes(needle: str = "") -> list[psutil.Process]:
    """Live processes started (directly or not) by this test process whose command line contains needle."""
    me, found = os.environ[SESSION_MARKER], []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (
                p.pid != os.getpid()
                and needle in " ".join(p.info["cmdline"] or [])
                and p.status() != psutil.STATUS_ZOMBIE
                and p.environ().get(SESSION_MARKER) == me
            ):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


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


MULTIPROCESSING_HELPER = "-c from multiprocessing."


def leftover_processes() -> list[psutil.Process]:
    """The live processes this test process started, but for a shared embedded server
    (PIPELINE_TEST_HOME's, which is meant to outlive the session) and its children, and this
    process's multiprocessing helpers (resource tracker, forkserver), which exit with it."""
    kept: set[int] = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if MULTIPROCESSING_HELPER in " ".join(child.cmdline()):
                kept.add(child.pid)
    if os.environ.get("PIPELINE_TEST_HOME"):
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            pid_file = Path(os.environ["PIPELINE_TEST_HOME"]) / "pgdata" / "postmaster.pid"
            postmaster = psutil.Process(int(pid_file.read_text().split()[0]))
            kept |= {postmaster.pid, *(c.pid for c in postmaster.children(recursive=True))}
    return [p for p in marked_processes() if p.pid not in kept]


# The slowest modules, slowest first (each module's summed test time, measured in a whole run). With
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
    "test_dagster_pending_buckets",
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
    as the topology's server): a flush per commit cost ~0.4 ms of CPU and ~3 ms of wall time here,
    and the suite commits many thousands of times (Dagster's event storage, the job table). A commit
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


def write_corpus(root: Path, n: int, *, prefix: str = "doc", words: int = 60) -> list[Path]:
    """n small distinct markdown documents."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = root / f"{prefix}{i:04d}.md"
        body = " ".join(f"w{(i * 7 + j) % 997}" for j in range(words))
        p.write_text(f"# {prefix} {i}\n\n{body}\n")
        paths.append(p)
    return paths


def cli(
    *args: str, env: dict, timeout: float = 120, check: bool = True, process: bool = False
) -> subprocess.CompletedProcess:
    """`pipeline-assets ARGS` with exactly the environment ``env``: its exit code, stdout and stderr.

    In this test process by default (click's CliRunner): the same command, settings read from
    ``env``, the same exit code and output, without a new interpreter's imports (1-2 s of CPU
    each). ``process=True`` runs it as a real process, for what is about the process itself (its
    exit status as the shell sees it, what a fresh interpreter imports or leaves running), and so
    does anything that starts servers or freezes (the embedded PostgreSQL of a missing database
    URL, a crashpoint), and a call from another thread than the main one (in-process, a command
    swaps process-wide state: the environment, the working directory, signal handlers).
    ``timeout`` bounds a real process; a hang in-process meets pytest-timeout.
    """
    if (
        process
        or not env.get("PIPELINE_DATABASE_URL")
        or env.get("PIPELINE_CRASHPOINT")
        or threading.current_thread() is not threading.main_thread()
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline_assets.cli", *args],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    else:
        proc = _cli_in_process(list(args), env)
    if check and proc.returncode != 0:
        raise AssertionError(f"pipeline-assets {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def _cli_in_process(args: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run the CLI's root group here, in ``env`` and REPO, then put back what a command changes
    process-wide (the environment, the working directory, logging, signal handlers)."""
    import logging
    import traceback

    from click.testing import CliRunner

    from pipeline_assets.cli import main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    warnings_captured = logging._warnings_showwarning is not None  # type: ignore[attr-defined]
    # Earlier tests' Dagster instances leave SQLite connections (SQLAlchemy's NullPool) for the
    # garbage collector, which may finalize them during this command, in another thread, and
    # log the failed reset through the root logger into this command's stderr. A real CLI
    # process holds no such connection (nothing in it uses SQLAlchemy), so those records stay
    # out of the command's output here.
    pool_logger = logging.getLogger("sqlalchemy.pool")
    saved_pool_propagate = pool_logger.propagate
    pool_logger.propagate = False
    pool_sink = logging.NullHandler()  # else logging's last resort prints them to stderr anyway
    pool_logger.addHandler(pool_sink)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    try:
        result = CliRunner().invoke(main, args, catch_exceptions=True)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
        logging.captureWarnings(warnings_captured)
        pool_logger.propagate = saved_pool_propagate
        pool_logger.removeHandler(pool_sink)
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        # What the interpreter prints for an uncaught exception (exit status 1).
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["pipeline-assets", *args], result.exit_code, result.stdout, stderr)


def start_cli(*args: str, env: dict) -> subprocess.Popen:
    """A CLI process in its own process group, so a test can SIGKILL the whole group."""
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline_assets.cli", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 120) -> str:
    """Read the process's stderr until a line containing needle (e.g. a CRASHPOINT)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if needle in line:
            return line
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"process never printed {needle!r} (exit {proc.poll()})")


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return any(p.status() != psutil.STATUS_ZOMBIE for p in _group_members(pgid))


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid:
                members.append(p)
    return members


def stop_group(proc: subprocess.Popen, first: int = signal.SIGTERM, grace: float = 60) -> int:
    """Stop a process started with ``start_new_session=True`` and its whole process group.

    ``first`` goes to the process (SIGINT: a clean shutdown it handles); once it exited (or after
    ``grace`` seconds), whatever is left of its group gets SIGTERM, then SIGKILL: a child that
    ignores SIGTERM (dagster's code server) or outlives its parent must not survive the test.
    Returns the process's exit code.
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(first)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.returncode is not None and not _group_alive(proc.pid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: proc.poll() is not None and not _group_alive(proc.pid),
                timeout=20,
                interval=0.1,
                what="the process group to exit",
            )
    proc.wait(timeout=30)
    assert not _group_alive(proc.pid), f"process group {proc.pid} survived SIGKILL"
    return proc.returncode


BUCKET_DOCUMENTS = """\
SELECT d.document_id FROM app.documents d JOIN app.sources s ON s.source_id = d.source_id
    WHERE s.root = %(root)s AND d.status <> 'deleted'
      AND (d.bucket = ANY(%(buckets)s::int[])
           OR d.bucket IS NULL AND app.document_bucket(d.document_id, %(n)s) = ANY(%(buckets)s::int[]))
    ORDER BY d.document_id COLLATE "C"
"""


def bucket_documents(conn, root: str, bucket_ids, bucket_count: int) -> list[str]:
    """The source's documents (current or quarantined) in some buckets, by their stored bucket or,
    without one, by the hash: the oracle of the per-bucket reads."""
    return [
        r[0]
        for r in conn.execute(BUCKET_DOCUMENTS, {"root": root, "n": bucket_count, "buckets": sorted(set(bucket_ids))})
    ]


def job_counts(conn) -> dict[str, int]:
    return dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY status").fetchall())


WAIT_FIRST_INTERVAL, WAIT_MAX_INTERVAL = 0.05, 0.5


def wait_until(predicate, timeout: float = 120, interval: float | None = None, what: str = "condition"):
    """Poll until predicate() is truthy; return its value. The default deadline is generous (a
    CLI process imports for many seconds on a loaded machine): it only bounds a failure.

    ``interval`` polls at that fixed rate (a transient state to catch); without it the polls start
    20 times a second and slow down to twice a second, so a long wait costs few predicate calls
    (a query, a process scan) and a short one still returns within a tick of its condition."""
    deadline = time.monotonic() + timeout
    pause = WAIT_FIRST_INTERVAL if interval is None else interval
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(pause)
        if interval is None:
            pause = min(WAIT_MAX_INTERVAL, pause * 1.25)
    raise AssertionError(f"timed out waiting for {what}")


def assert_vectors_match(conn, fake, model_id: str = f"openai/{FAKE_MODEL}") -> int:
    """Every current chunk has a vector, and it is exactly the fake's vector for the chunk text."""
    import numpy as np

    rows = conn.execute(
        """
        SELECT c.text, e.embedding FROM app.chunks c
        JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
        LEFT JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %s""",
        (model_id,),
    ).fetchall()
    assert rows, "no current chunks"
    for text, vec in rows:
        assert vec is not None, f"no vector for current chunk {text[:40]!r}"
        assert np.allclose(vec.to_numpy(), fake.vector_for(text), atol=1e-6), text[:40]
    return len(rows)
