"""What the topology scenarios share: the module-scoped ``topo`` fixture's figures, databases of
their own on the db host, drains by worker hosts, and outcome checks (rows, vectors, bills).

Figures (ratios, throughput) are collected in :data:`FIGURES`, printed and written to
``topology-figures.json`` in the basetemp when a module's topology closes.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import numpy as np
import psycopg

from pipeline_assets.store.db import DatabaseUnavailable
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.fake_openai_wire import _vector
from pipeline_assets_tests.processes import REPO, wait_until
from pipeline_assets_tests.topology.hosts import Topology
from pipeline_assets_tests.topology.services import DB_PASSWORD, DB_ROLE, DIM

MODEL_ID = f"openai/{FAKE_MODEL}"
FIGURES: dict = {}


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def counts(conn: psycopg.Connection) -> dict[str, int]:
    return dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall())


def assert_vectors(conn: psycopg.Connection) -> int:
    """Every current chunk has exactly one vector, the provider's vector for its text."""
    rows = conn.execute(
        """
        SELECT c.text, e.embedding FROM app.chunks c
        JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
        LEFT JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %s""",
        (MODEL_ID,),
    ).fetchall()
    assert rows
    for text, vec in rows:
        assert vec is not None, f"no vector for {text[:40]!r}"
        assert np.allclose(np.asarray(vec.to_numpy()), _vector(text, DIM), atol=1e-6), text[:40]
    twice = conn.execute(
        "SELECT count(*) FROM (SELECT 1 FROM app.embeddings GROUP BY chunk_checksum, model_id HAVING count(*) > 1) x"
    ).fetchone()[0]
    assert twice == 0
    return len(rows)


def new_database(topo: Topology, name: str, docs: int, *, words: int = 20, hold: bool = True) -> psycopg.Connection:
    """A migrated database ``name`` with ``docs`` one-chunk documents ingested (jobs held back
    with available_at = infinity when ``hold``); returns a connection to it (direct, not pooled)."""
    with topo.admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    src = topo.tmp / f"corpus-{name}"
    write_corpus(src, docs, prefix=name, words=words)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline_assets.cli", "ingest", str(src)],
        env=topo.pipeline_env(name),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    conn = topo.connect(name)
    if hold:
        conn.execute("UPDATE app.embedding_jobs SET available_at = 'infinity'")
    return conn


def drop_corpus(topo: Topology, name: str, docs: int, *, words: int = 40) -> None:
    """``docs`` documents (prefix ``name``) appear at once in the watched directory, under ``name/``:
    written beside it, then renamed into it, so no sensor tick sees a part of them."""
    staging = topo.tmp / f"staging-{name}"
    write_corpus(staging, docs, prefix=name, words=words)
    staging.rename(topo.source / name)


def copy_database(topo: Topology, template: str, name: str) -> psycopg.Connection:
    with topo.admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return topo.connect(name)


def scalar(conn: psycopg.Connection, query: str, params=None):
    return conn.execute(query, params).fetchone()[0]


def drain(
    topo: Topology,
    conn: psycopg.Connection,
    dbname: str,
    hosts: list[str],
    *,
    timeout: float = 300,
    args: tuple[str, ...] = (),
    **extra: str,
) -> dict:
    """Start a worker on each host, wait until all registered, release the jobs, wait until none is
    left to do; return the drain window from the spend ledger (first send to last answer)."""
    total = scalar(conn, "SELECT count(*) FROM app.embedding_jobs")
    procs = [topo.start_worker(h, dbname, *args, **extra) for h in hosts]
    try:
        wait_until(
            lambda: (
                scalar(conn, "SELECT count(*) FROM app.workers") >= len(hosts)
                or any(p.poll() is not None for p in procs)
            ),
            timeout=120,
            interval=0.2,
            what="the workers to register",
        )
        assert all(p.poll() is None for p in procs), [topo.log_tail(f"worker-{h}-{dbname}") for h in hosts]
        conn.execute("UPDATE app.embedding_jobs SET available_at = now()")
        wait_until(
            lambda: (
                scalar(
                    conn, "SELECT count(*) FROM app.embedding_jobs WHERE status IN ('ready', 'failed', 'superseded')"
                )
                >= total
                or any(p.poll() is not None for p in procs)
            ),
            timeout=timeout,
            interval=0.2,
            what="the drain",
        )
        assert all(p.poll() is None for p in procs), [topo.log_tail(f"worker-{h}-{dbname}") for h in hosts]
    finally:
        topo.stop_workers(procs)
    window, calls = conn.execute(
        "SELECT extract(epoch FROM max(answered_at) - min(called_at)), count(*)"
        " FROM app.provider_calls WHERE billed = 'yes'"
    ).fetchone()
    return {
        "jobs": total,
        "window_s": float(window),
        "calls": calls,
        "jobs_per_s": round(total / float(window), 1),
        "counts": counts(conn),
    }


def location_loaded(topo: Topology) -> bool:
    """The webserver shows the code location loaded (not an error, not loading)."""
    try:
        data = topo.graphql("""{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus
                                 locationOrLoadError { __typename } } } } }""")
        entries = data["workspaceOrError"]["locationEntries"]
    except (OSError, AssertionError):
        return False
    return any(
        e["loadStatus"] == "LOADED" and e["locationOrLoadError"]["__typename"] == "RepositoryLocation" for e in entries
    )


def sensor_ticked_since(topo: Topology, since: float, sensor: str = "source_documents") -> bool:
    """The daemon evaluated ``sensor`` through the code server after ``since`` (epoch seconds): a
    tick that ended SKIPPED or SUCCESS. The daemon keeps its own copy of the workspace: a location
    that failed to load while the code server was down stays failed there until it reloads
    (backfills fail without a run, sensor ticks fail), whatever the webserver shows."""
    selector = {"repositoryLocationName": "pipeline_assets", "repositoryName": "__repository__", "sensorName": sensor}
    try:
        found = topo.graphql(
            """query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) {
                 ... on Sensor { sensorState { ticks(limit: 5) { status timestamp } } } } }""",
            {"s": selector},
        )["sensorOrError"]
    except (OSError, AssertionError):
        return False
    ticks = (found.get("sensorState") or {}).get("ticks") or []
    return any(t["status"] in ("SKIPPED", "SUCCESS") and t["timestamp"] > since for t in ticks)


def graphql_runs(topo: Topology, trigger: str | None = None) -> list[dict]:
    """The deployment's runs; with ``trigger``, those a sensor of that name asked for (its tag)."""
    if trigger is None:
        data = topo.graphql("""{ runsOrError(limit: 500) { ... on Runs { results { runId status jobName } } } }""")
    else:
        data = topo.graphql(
            """query($v: String!) { runsOrError(limit: 500, filter: {tags: [{key: "pipeline/trigger",
                 value: $v}]}) { ... on Runs { results { runId status jobName } } } }""",
            {"v": trigger},
        )
    return data["runsOrError"]["results"]


def run_steps(topo: Topology, run_id: str) -> tuple[str, dict[str, str | None]]:
    """A run's status and its steps' (``{step key: IN_PROGRESS | SUCCESS | FAILURE | SKIPPED}``)."""
    run = topo.graphql(
        """query($id: ID!) { runOrError(runId: $id) { ... on Run { status stepStats { stepKey status } } } }""",
        {"id": run_id},
    )["runOrError"]
    return run["status"], {s["stepKey"]: s["status"] for s in run["stepStats"]}


def metric(topo: Topology, host: str, port: int, name: str) -> float:
    """The sum of a Prometheus metric's samples whose line starts with ``name``."""
    with urllib.request.urlopen(f"http://{topo.addr(host)}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def billed_for(topo: Topology, prefix: str) -> dict[str, int]:
    """The provider's bills of this corpus's texts (each document's text starts with its prefix)."""
    billed = topo.provider_stats(brief=False)["billed_by_text"]
    return {t: n for t, n in billed.items() if t.startswith(f"# {prefix} ")}


def reconnect(topo: Topology, name: str) -> psycopg.Connection:
    def attempt():
        try:
            return topo.connect(name)
        except DatabaseUnavailable:
            return None

    return wait_until(attempt, timeout=60, interval=0.5, what="the database to accept connections")


def round_trip_s(topo: Topology, endpoint: str, dbname: str, samples: int = 5) -> float:
    """The median time of ``SELECT 1`` through PgBouncer at ``endpoint`` (ADDR:PORT)."""
    url = f"postgresql://{DB_ROLE}@{endpoint}/{dbname}"
    with psycopg.connect(url, password=DB_PASSWORD, autocommit=True, connect_timeout=30, prepare_threshold=None) as c:
        times = []
        for _ in range(samples):
            t = time.monotonic()
            c.execute("SELECT 1").fetchone()
            times.append(time.monotonic() - t)
    return sorted(times)[len(times) // 2]


def main_conn(topo: Topology) -> psycopg.Connection:
    return topo.connect("pipeline")


def wait_current_and_ready(topo: Topology, conn: psycopg.Connection, documents: int, workers, timeout: float) -> None:
    def done() -> bool:
        for h, w in zip(topo.worker_hosts, workers):
            assert w.poll() is None, topo.log_tail(f"worker-{h}-pipeline")
        current = scalar(conn, "SELECT count(*) FROM app.documents WHERE status = 'current'")
        c = counts(conn)
        return current == documents and bool(c) and set(c) == {"ready"}

    wait_until(done, timeout=timeout, interval=1, what=f"{documents} documents current and embedded")
