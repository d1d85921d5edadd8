"""Least-privilege roles (`pipeline-assets roles`, sql/queries/roles.sql) on the real server.

A database created empty, the roles applied by an administrator, the schema migrated by the
owner role; then the worker role cannot change the schema and `ingest`, `work` (the fake
provider, through the real openai SDK), `status` and `search` all work under it, the reader
can only read, and a table a later migration creates is the worker's and reader's at once.
"""

from __future__ import annotations

import json
import os
import signal
import uuid

import psycopg
import pytest

from pipeline_assets.registry import vector_index
from pipeline_assets.store import db
from pipeline_assets.store import roles as db_roles
from pipeline_assets_tests.conftest import FAKE_MODEL, FAKE_WINDOW
from pipeline_assets_tests.data_helpers import assert_vectors_match, write_corpus
from pipeline_assets_tests.processes import cli, start_cli, wait_until

PASSWORD = "r0le-s3cret"


@pytest.fixture(scope="module")
def deployment(server_url):
    """An empty database and three fresh roles (cluster-wide: unique names), dropped at the end."""
    suffix = uuid.uuid4().hex[:8]
    name = f"t_roles_{suffix}"
    names = db_roles.RoleNames(f"own_{suffix}", f"wrk_{suffix}", f"rdr_{suffix}")
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    admin_url = psycopg.conninfo.make_conninfo(server_url, dbname=name)
    yield admin_url, names
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        for role in names.all():
            if admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                admin.execute(f'DROP OWNED BY "{role}"')
                admin.execute(f'DROP ROLE "{role}"')


def _as(url: str, role: str) -> str:
    return psycopg.conninfo.make_conninfo(url, user=role, password=PASSWORD)


def _env(url: str, fake, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "OPENAI_"))}
    env.update(
        {
            "PIPELINE_DATABASE_URL": url,
            "OPENAI_API_KEY": "test-key",
            "OPENAI_BASE_URL": fake.base_url,
            "PIPELINE_EMBEDDING_MODEL": FAKE_MODEL,
            "PIPELINE_MODEL_MAX_INPUT_TOKENS": str(FAKE_WINDOW),
            "PIPELINE_BACKOFF_BASE": "0.05",
            "PIPELINE_BACKOFF_CAP": "0.2",
            "PIPELINE_CALL_TIMEOUT": "5",
            "PIPELINE_HOME": str(tmp_path / "home"),
        }
    )
    return env


@pytest.fixture(scope="module")
def migrated(deployment, tmp_path_factory):
    """The roles applied by the administrator (twice: idempotent), the schema migrated by the owner."""
    admin_url, names = deployment
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    args = ("roles", "--owner", names.owner, "--worker", names.worker, "--reader", names.reader)
    first = cli(*args, env={**env, "PIPELINE_DATABASE_URL": admin_url})
    assert "created " + ", ".join(names.all()) in first.stdout
    assert "created" not in cli(*args, env={**env, "PIPELINE_DATABASE_URL": admin_url}).stdout
    with psycopg.connect(admin_url, autocommit=True) as admin:
        for role in names.all():  # the administrator's step, out of band: never the command's
            admin.execute(f"ALTER ROLE \"{role}\" PASSWORD '{PASSWORD}'")
    out = cli("migrate", env={**env, "PIPELINE_DATABASE_URL": _as(admin_url, names.owner)}).stdout
    assert "001_core.sql" in out
    with psycopg.connect(admin_url) as admin:
        owners = {r[0] for r in admin.execute("SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = 'app'")}
    assert owners == {names.owner}
    return admin_url, names


def test_the_worker_role_cannot_change_the_schema(migrated):
    admin_url, names = migrated
    ddl = [
        "CREATE TABLE app.intruder (x int)",
        "ALTER TABLE app.embedding_jobs ADD COLUMN intruder int",
        "DROP TABLE app.embedding_jobs",
        "CREATE INDEX intruder ON app.embeddings (model_id)",
        "CREATE FUNCTION app.intruder() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        "TRUNCATE app.embedding_jobs",
    ]
    for role in (names.worker, names.reader):
        with psycopg.connect(_as(admin_url, role), autocommit=True) as conn:
            conn.execute("SET default_transaction_read_only = off")  # the privileges alone refuse it
            for statement in ddl:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
    with psycopg.connect(_as(admin_url, names.reader), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("DELETE FROM app.embedding_jobs")
        conn.execute("SET default_transaction_read_only = off")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM app.embedding_jobs")


def test_everything_works_under_the_worker_role(migrated, fake, tmp_path):
    admin_url, names = migrated
    worker_env = _env(_as(admin_url, names.worker), fake, tmp_path)
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 6)
    ingested = json.loads(cli("ingest", str(corpus), "--json", env=worker_env).stdout)
    assert ingested["enqueued"] > 0
    status = json.loads(cli("status", "--json", env=worker_env).stdout)
    assert status["backlog"] == ingested["enqueued"]
    worked = cli("work", "--until-idle", "--json", env=worker_env)
    assert json.loads(worked.stdout)["embedded"] == ingested["enqueued"]
    assert "could not build" not in worked.stderr and "permission denied" not in worked.stderr
    with db.connect(admin_url) as conn:
        assert assert_vectors_match(conn, fake) == ingested["enqueued"]
    status = json.loads(cli("status", "--json", env=worker_env).stdout)
    assert status["backlog"] == 0 and status["jobs"] == {"ready": ingested["enqueued"]}
    hits = json.loads(cli("search", "w7 w14 w21", "--json", env=worker_env).stdout)
    assert hits and all(h["document_id"].startswith("doc") for h in hits)

    # The reader: status as the worker saw it, no write.
    reader_env = _env(_as(admin_url, names.reader), fake, tmp_path)
    assert json.loads(cli("status", "--json", env=reader_env).stdout)["jobs"] == status["jobs"]

    # The vector index is the owner's to build: the worker left it without a warning, and
    # `models index` under the worker role says whose it is in one line.
    refused = cli("models", "index", FAKE_MODEL, env=worker_env, check=False)
    assert refused.returncode == 1 and "as the owner role" in refused.stderr
    assert "Traceback" not in refused.stderr
    owner_env = _env(_as(admin_url, names.owner), fake, tmp_path)
    cli("models", "index", FAKE_MODEL, env=owner_env)
    with psycopg.connect(admin_url) as conn:
        assert (
            conn.execute(
                "SELECT count(*) FROM pg_indexes WHERE schemaname = 'app' AND indexname LIKE 'embeddings_hnsw_%'"
            ).fetchone()[0]
            == 1
        )


def test_a_later_migrations_table_is_the_workers_at_once(migrated):
    admin_url, names = migrated
    with psycopg.connect(_as(admin_url, names.owner), autocommit=True) as owner:
        owner.execute("CREATE TABLE app.later_046 (id bigint GENERATED ALWAYS AS IDENTITY, note text)")
        owner.execute("CREATE FUNCTION app.later_fn() RETURNS int LANGUAGE sql AS 'SELECT 46'")
    try:
        with psycopg.connect(_as(admin_url, names.worker), autocommit=True) as worker:
            worker.execute("INSERT INTO app.later_046 (note) VALUES ('x')")
            assert worker.execute("SELECT app.later_fn()").fetchone()[0] == 46
        with psycopg.connect(_as(admin_url, names.reader), autocommit=True) as reader:
            assert reader.execute("SELECT count(*) FROM app.later_046").fetchone()[0] == 1
    finally:
        with psycopg.connect(_as(admin_url, names.owner), autocommit=True) as owner:
            owner.execute("DROP TABLE app.later_046")
            owner.execute("DROP FUNCTION app.later_fn()")


def test_print_shows_the_statements_without_running_them(deployment):
    admin_url, _ = deployment
    names = db_roles.RoleNames("p_own", "p_wrk", "p_rdr")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPELINE_")}
    out = cli(
        "roles",
        "--print",
        "--owner",
        names.owner,
        "--worker",
        names.worker,
        "--reader",
        names.reader,
        env={**env, "PIPELINE_DATABASE_URL": admin_url},
    ).stdout
    assert 'CREATE ROLE "p_wrk" LOGIN;' in out
    assert 'ALTER DEFAULT PRIVILEGES FOR ROLE "p_own" IN SCHEMA app' in out
    assert "PASSWORD" not in out
    with psycopg.connect(admin_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'p\\_%'").fetchone()[0] == 0


def test_a_workers_connections_are_what_the_sizing_counts(migrated, fake, tmp_path):
    """docs/operations.md, Sizing: a worker holds its job pool (concurrency + 2), its liveness
    connection and the command's own pool (one): counted by the worker role on the server while it
    works (its own role: nothing else connects as it), and none left once SIGTERM stopped it."""
    admin_url, names = migrated
    worker_env = _env(_as(admin_url, names.worker), fake, tmp_path)
    write_corpus(tmp_path / "sizing", 40, prefix="size")
    cli("ingest", str(tmp_path / "sizing"), env=worker_env)
    fake.latency = 0.2  # calls in flight while it is counted
    concurrency = 3
    proc = start_cli("work", "--concurrency", str(concurrency), env=worker_env)
    seen: list[int] = []
    try:
        with psycopg.connect(admin_url, autocommit=True) as admin:

            def busy() -> bool:
                seen.append(
                    admin.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (names.worker,)
                    ).fetchone()[0]
                )
                return (
                    admin.execute("SELECT count(*) FROM app.embedding_jobs WHERE status = 'processing'").fetchone()[0]
                    >= concurrency
                )

            wait_until(busy, timeout=60, interval=0.05, what="the worker's calls in flight")
            for _ in range(10):  # a few samples while it works
                busy()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0

            def left() -> int:
                row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (names.worker,))
                return row.fetchone()[0]

            # A backend leaves pg_stat_activity when it has read its client's end, just after the client
            # exited; a connection something still held would stay.
            wait_until(lambda: left() == 0, timeout=15, interval=0.05, what="the worker's backends to end")
    finally:
        fake.latency = 0.0
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"worker connections (concurrency {concurrency}): max {max(seen)}")
    assert max(seen) <= concurrency + 2 + 1 + 1 + 1  # job pool, liveness, the command's pool, a build


def test_a_model_switch_and_purge_under_the_worker_role(migrated, fake, tmp_path):
    """Retire and purge run by the worker role (reconcile in Dagster): the vectors go, the
    purged model's index is the owner's to drop, which its next `models purge` does."""
    admin_url, names = migrated
    worker_env = _env(_as(admin_url, names.worker), fake, tmp_path)
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 4, prefix="switch")
    cli("embed", str(corpus), env=worker_env)
    cli("models", "index", FAKE_MODEL, env=_env(_as(admin_url, names.owner), fake, tmp_path))
    new_name, new_dims = "fake-embed-2", 8
    new_env = {**worker_env, "PIPELINE_EMBEDDING_MODEL": new_name, "PIPELINE_EMBEDDING_DIMENSIONS": str(new_dims)}
    cli("models", "add", new_name, "--dimensions", str(new_dims), env=worker_env)
    cli("work", "--until-idle", env=new_env)
    new = f"openai/{new_name}@{new_dims}"
    cli("models", "serve", new, env=worker_env)
    cli("models", "retire", FAKE_MODEL, env=worker_env)
    old = f"openai/{FAKE_MODEL}"

    report = json.loads(cli("reconcile", "--json", env={**new_env, "PIPELINE_MODEL_RETIRE_GRACE": "0"}).stdout)
    assert report["purged_models"] == 1
    with psycopg.connect(admin_url) as conn:
        assert conn.execute("SELECT count(*) FROM app.embeddings WHERE model_id = %s", (old,)).fetchone()[0] == 0
        assert vector_index.exists(conn, old)  # left for the owner
    owner_env = _env(_as(admin_url, names.owner), fake, tmp_path)
    assert cli("models", "purge", env={**owner_env, "PIPELINE_MODEL_RETIRE_GRACE": "0"}).returncode == 0
    with psycopg.connect(admin_url) as conn:
        assert not vector_index.exists(conn, old)


def test_a_pending_migration_under_the_worker_role_says_who_migrates(migrated, fake, tmp_path):
    """A release's workers started before its migrations ran: one line naming the command and the
    role, not the server's bare `permission denied`; up to date again, they start."""
    admin_url, names = migrated
    with psycopg.connect(admin_url, autocommit=True) as admin:
        last = admin.execute("SELECT max(version) FROM app.schema_migrations").fetchone()[0]
        admin.execute("DELETE FROM app.schema_migrations WHERE version = %s", (last,))
    worker_env = _env(_as(admin_url, names.worker), fake, tmp_path)
    for args in (("status",), ("work", "--until-idle")):
        proc = cli(*args, env=worker_env, check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(
            f"error: the database is not migrated to this release and role {names.worker} may not migrate it"
        ), proc.stderr
        assert "`pipeline-assets migrate` as the schema's owner role" in proc.stderr
        assert PASSWORD not in proc.stderr
    # The ledger as it was: up to date, the worker role starts again.
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute("INSERT INTO app.schema_migrations (version) VALUES (%s)", (last,))
    assert cli("status", env=worker_env).returncode == 0
