"""The production topology, host by host, with faults between the hosts (root only).

One module-scoped :class:`Topology` (hosts started once); the scenarios run in this order, each on
a database of its own on the db host (except the first, which is the Dagster deployment's), so one
scenario's leftovers never decide another's outcome. Each asserts outcomes: rows, vectors, bills.
Figures (ratios, throughput) are printed and written to ``topology-figures.json`` in the basetemp.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import psycopg
import pytest

from pipeline_assets_tests.conftest import FAKE_MODEL, REPO, wait_until, write_corpus
from pipeline_assets_tests.fake_openai import _vector
from pipeline_assets_tests.topology.hosts import DB_PASSWORD, DIM, Topology, missing_requirements

_why_not = missing_requirements()
pytestmark = [pytest.mark.skipif(_why_not is not None, reason=_why_not or ""),
              pytest.mark.timeout(900)]

MODEL_ID = f"openai/{FAKE_MODEL}"
CORPUS_DOCS = 5000
FIGURES: dict = {}


@pytest.fixture(scope="module")
def topo(tmp_path_factory):
    t = Topology(workers=3)
    try:
        started = time.monotonic()
        t.start()
        FIGURES["start_s"] = round(time.monotonic() - started, 1)
        yield t
    finally:
        t.close()
        out = tmp_path_factory.getbasetemp() / "topology-figures.json"
        out.write_text(json.dumps(FIGURES, indent=2))
        print("\ntopology figures:", json.dumps(FIGURES), file=sys.stderr)


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ---- helpers ------------------------------------------------------------------------------------
def counts(conn: psycopg.Connection) -> dict[str, int]:
    return dict(conn.execute("SELECT status, count(*) FROM app.embedding_jobs GROUP BY 1").fetchall())


def assert_vectors(conn: psycopg.Connection) -> int:
    """Every current chunk has exactly one vector, the provider's vector for its text."""
    rows = conn.execute("""
        SELECT c.text, e.embedding FROM app.chunks c
        JOIN app.documents d ON d.doc_pk = c.doc_pk AND d.status = 'current'
        LEFT JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %s""",
                        (MODEL_ID,)).fetchall()
    assert rows
    for text, vec in rows:
        assert vec is not None, f"no vector for {text[:40]!r}"
        assert np.allclose(np.asarray(vec.to_numpy()), _vector(text, DIM), atol=1e-6), text[:40]
    twice = conn.execute("SELECT count(*) FROM (SELECT 1 FROM app.embeddings GROUP BY chunk_checksum, model_id"
                         " HAVING count(*) > 1) x").fetchone()[0]
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
    done = subprocess.run([sys.executable, "-m", "pipeline_assets.cli", "ingest", str(src)],
                          env=topo.pipeline_env(name), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    conn = psycopg.connect(topo.db_url(name), password=DB_PASSWORD, autocommit=True)
    from pipeline_assets.store import db
    db._configure(conn)
    if hold:
        conn.execute("UPDATE app.embedding_jobs SET available_at = 'infinity'")
    return conn


def copy_database(topo: Topology, template: str, name: str) -> psycopg.Connection:
    with topo.admin() as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    conn = psycopg.connect(topo.db_url(name), password=DB_PASSWORD, autocommit=True)
    from pipeline_assets.store import db
    db._configure(conn)
    return conn


def scalar(conn: psycopg.Connection, query: str, params=None):
    return conn.execute(query, params).fetchone()[0]


def drain(topo: Topology, conn: psycopg.Connection, dbname: str, hosts: list[str], *,
          timeout: float = 300, args: tuple[str, ...] = (), **extra: str) -> dict:
    """Start a worker on each host, wait until all registered, release the jobs, wait until none is
    left to do; return the drain window from the spend ledger (first send to last answer)."""
    total = scalar(conn, "SELECT count(*) FROM app.embedding_jobs")
    procs = [topo.start_worker(h, dbname, *args, **extra) for h in hosts]
    try:
        wait_until(lambda: scalar(conn, "SELECT count(*) FROM app.workers") >= len(hosts)
                   or any(p.poll() is not None for p in procs), timeout=120, interval=0.2,
                   what="the workers to register")
        assert all(p.poll() is None for p in procs), [topo.log_tail(f"worker-{h}-{dbname}") for h in hosts]
        conn.execute("UPDATE app.embedding_jobs SET available_at = now()")
        wait_until(lambda: scalar(conn, "SELECT count(*) FROM app.embedding_jobs WHERE status IN"
                                        " ('ready', 'failed', 'superseded')") >= total
                   or any(p.poll() is not None for p in procs), timeout=timeout, interval=0.2, what="the drain")
        assert all(p.poll() is None for p in procs), [topo.log_tail(f"worker-{h}-{dbname}") for h in hosts]
    finally:
        topo.stop_workers(procs)
    window, calls = conn.execute("SELECT extract(epoch FROM max(answered_at) - min(called_at)), count(*)"
                                 " FROM app.provider_calls WHERE billed = 'yes'").fetchone()
    return {"jobs": total, "window_s": float(window), "calls": calls,
            "jobs_per_s": round(total / float(window), 1), "counts": counts(conn)}


def graphql_runs(topo: Topology) -> list[dict]:
    data = topo.graphql("""{ runsOrError(limit: 500) { ... on Runs { results { runId status jobName } } } }""")
    return data["runsOrError"]["results"]


# ---- scenarios ----------------------------------------------------------------------------------
def test_corpus_made_current_by_the_sensor_and_embedded_by_the_worker_hosts(topo):
    """5,000 documents dropped in the watched directory: the source sensor (code host, via the
    daemon) brings every bucket current, the three worker hosts embed every chunk through PgBouncer,
    every input billed once; `status` agrees with the database, the Dagster runs succeeded."""
    write_corpus(topo.source, CORPUS_DOCS, prefix="corpus", words=40)
    started = time.monotonic()
    workers = [topo.start_worker(h, "pipeline") for h in topo.worker_hosts]
    conn = psycopg.connect(topo.db_url(), password=DB_PASSWORD, autocommit=True)
    from pipeline_assets.store import db
    db._configure(conn)

    def done() -> bool:
        for name in ("webserver", "daemon", "code"):
            assert topo.services[name].poll() is None, f"{name} exited:\n{topo.log_tail(name)}"
        for h, w in zip(topo.worker_hosts, workers):
            assert w.poll() is None, topo.log_tail(f"worker-{h}-pipeline")
        current = scalar(conn, "SELECT count(*) FROM app.documents WHERE status = 'current'")
        c = counts(conn)
        return current == CORPUS_DOCS and c and set(c) == {"ready"}
    wait_until(done, timeout=480, interval=1, what="the corpus to be current and embedded")
    FIGURES["corpus"] = {"documents": CORPUS_DOCS, "seconds": round(time.monotonic() - started, 1),
                         "load": load()}
    chunks = assert_vectors(conn)
    stats = topo.provider_stats(brief=False)
    billed = stats["billed_by_text"]
    assert len(billed) == chunks and set(billed.values()) == {1}, "every input billed exactly once"

    def runs_settled() -> list[dict] | None:
        runs = graphql_runs(topo)
        busy = [r for r in runs if r["status"] in ("QUEUED", "NOT_STARTED", "STARTING", "STARTED")]
        return None if busy or not runs else runs
    runs = wait_until(runs_settled, timeout=240, interval=1, what="the Dagster runs to finish")
    assert {r["status"] for r in runs} == {"SUCCESS"}, runs
    status = json.loads(subprocess.run([sys.executable, "-m", "pipeline_assets.cli", "status", "--json"],
                                       env=topo.pipeline_env(), cwd=REPO, capture_output=True, text=True,
                                       timeout=120, check=True).stdout)
    assert status["jobs"].get("ready") == chunks
    assert status["documents"].get("current") == CORPUS_DOCS
    assert status["coverage"][MODEL_ID]["ratio"] == 1.0
    conn.close()
    topo.stop_workers(workers)


def test_scale_out_three_worker_hosts_against_one(topo):
    """A 200 ms provider: three worker hosts drain the same queue at least 2.7x faster than one."""
    topo.provider_faults(latency=0.2)
    try:
        template = new_database(topo, "scale_t", 1200)
        template.close()
        one = copy_database(topo, "scale_t", "scale1")
        three = copy_database(topo, "scale_t", "scale3")
        opts = {"PIPELINE_BATCH_INPUTS": "8"}
        r1 = drain(topo, one, "scale1", topo.worker_hosts[:1], args=("--concurrency", "2"), **opts)
        r3 = drain(topo, three, "scale3", topo.worker_hosts, args=("--concurrency", "2"), **opts)
    finally:
        topo.provider_faults(latency=0.0)
    ratio = r1["window_s"] / r3["window_s"]
    FIGURES["scale_out"] = {"one": r1, "three": r3, "ratio": round(ratio, 2), "load": load()}
    for r in (r1, r3):
        assert r["counts"] == {"ready": 1200}
    for c in (one, three):
        assert_vectors(c)
        assert scalar(c, "SELECT coalesce(sum(sends - 1), 0) FROM app.input_sends") == 0
        c.close()
    assert ratio >= 2.7, FIGURES["scale_out"]
