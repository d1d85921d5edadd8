"""The production topology, host by host (root only): the Dagster deployment (webserver and daemon
on the orchestration host, the code server on its own) with the worker hosts behind PgBouncer.

One module-scoped topology (``topo`` in conftest.py); the scenarios run in this order on the
deployment's database: the corpus through the source sensor, the code server killed during a run,
a backfill through the webserver. Each asserts outcomes: rows, vectors, bills. The worker-host
scenarios on databases of their own: test_topology_scale.py and test_topology_faults.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pipeline_assets.defs.ingest.sync_and_embed import EMBED_OP, SYNC_OP
from pipeline_assets.defs.reconcile.jobs import RECONCILE_JOB_NAME
from pipeline_assets.defs.run_requests import EMBED_JOB_NAME, SYNC_EMBED_JOB_NAME, SYNC_JOB_NAME
from pipeline_assets_tests.conftest import LONG_PROFILE
from pipeline_assets_tests.processes import REPO, wait_until
from pipeline_assets_tests.topology.scenarios import (
    FIGURES,
    MODEL_ID,
    assert_vectors,
    billed_for,
    counts,
    drop_corpus,
    graphql_runs,
    load,
    location_loaded,
    main_conn,
    run_steps,
    scalar,
    sensor_ticked_since,
    wait_current_and_ready,
)
from pipeline_assets_tests.topology.services import missing_requirements

_why_not = missing_requirements()
pytestmark = [pytest.mark.skipif(_why_not is not None, reason=_why_not or ""), pytest.mark.timeout(900)]

# The short profile's 400 documents: six a bucket on average (a few buckets empty: the first run
# materializes those too); every 5 s tick of the source sensor lists the whole source (the ticks run
# for the whole module). The long profile keeps the 5,000-document corpus.
CORPUS_DOCS = 5000 if LONG_PROFILE else 400
# Documents added while the deployment runs: one sync_and_embed run over their buckets.
LATE_DOCS = 40
BUSY = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED")
SOURCE_SENSOR = "source_documents"  # the runs it asks for, and the embeddings run after its sync


# ---- scenarios ----------------------------------------------------------------------------------
def test_corpus_made_current_by_the_sensor_and_embedded_by_the_worker_hosts(topo):
    """CORPUS_DOCS documents dropped in the watched directory: the source sensor (code host, via the
    daemon) brings every bucket current, the three worker hosts embed every chunk through PgBouncer,
    every input billed once; `status` agrees with the database, the Dagster runs succeeded: the
    sensor's sync run and the embeddings run the sync is followed by (nothing left in flight)."""
    drop_corpus(topo, "corpus", CORPUS_DOCS)
    started = time.monotonic()
    workers = [topo.start_worker(h, "pipeline") for h in topo.worker_hosts]
    conn = topo.connect("pipeline")

    def done() -> bool:
        for name in ("webserver", "daemon", "code"):
            assert topo.services[name].poll() is None, f"{name} exited:\n{topo.log_tail(name)}"
        for h, w in zip(topo.worker_hosts, workers):
            assert w.poll() is None, topo.log_tail(f"worker-{h}-pipeline")
        current = scalar(conn, "SELECT count(*) FROM app.documents WHERE status = 'current'")
        c = counts(conn)
        return current == CORPUS_DOCS and c and set(c) == {"ready"}

    wait_until(done, timeout=480, interval=1, what="the corpus to be current and embedded")
    FIGURES["corpus"] = {"documents": CORPUS_DOCS, "seconds": round(time.monotonic() - started, 1), "load": load()}
    chunks = assert_vectors(conn)
    stats = topo.provider_stats(brief=False)
    billed = stats["billed_by_text"]
    assert len(billed) == chunks and set(billed.values()) == {1}, "every input billed exactly once"

    def runs_settled() -> list[dict] | None:
        runs = graphql_runs(topo, SOURCE_SENSOR)
        busy = [r for r in runs if r["status"] in BUSY]
        return None if busy or EMBED_JOB_NAME not in {r["jobName"] for r in runs} else runs

    runs = wait_until(runs_settled, timeout=240, interval=1, what="the sync run and the embeddings run after it")
    assert {r["status"] for r in runs} == {"SUCCESS"}, runs
    assert sorted(r["jobName"] for r in runs) == [EMBED_JOB_NAME, SYNC_JOB_NAME], runs
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "pipeline_assets.cli", "status", "--json"],
            env=topo.pipeline_env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    )
    assert status["jobs"].get("ready") == chunks
    assert status["documents"].get("current") == CORPUS_DOCS
    assert status["coverage"][MODEL_ID]["ratio"] == 1.0
    topo.stop_workers(workers)
    # Observed, not asserted: the index build's session advisory lock, taken through transaction pooling.
    FIGURES["corpus"]["vector_index"] = status.get("vector_index", status.get("vector_indexes"))
    FIGURES["corpus"]["advisory_locks_left"] = scalar(conn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'")
    conn.close()


def test_code_server_killed_during_a_run(topo):
    """The code server (where runs execute) SIGKILLed while a sensor-launched run is in progress: the
    late documents' sync_and_embed run, its sync done and its embeddings step waiting for the worker
    hosts (none running yet). The daemon fails to reach it while it is down; it is started again,
    as a supervisor would, and a worker host then. The one path to convergence: the run's process
    outlives the code server and the run succeeds, no relaunch, retry or reconciliation run. Every
    new document current and embedded, every input billed once; the webserver shows the location
    loaded and the daemon's sensors tick through the restarted code server."""
    conn = main_conn(topo)
    before = scalar(conn, "SELECT count(*) FROM app.documents WHERE status = 'current'")
    known = {r["runId"] for r in graphql_runs(topo)}
    drop_corpus(topo, "late", LATE_DOCS)

    def embedding_step_running() -> str | None:
        runs = [r for r in graphql_runs(topo, SOURCE_SENSOR) if r["runId"] not in known]
        assert len(runs) <= 1 and all(r["jobName"] == SYNC_EMBED_JOB_NAME for r in runs), runs
        if not runs or runs[0]["status"] != "STARTED":
            assert not runs or runs[0]["status"] in BUSY, runs
            return None
        status, steps = run_steps(topo, runs[0]["runId"])
        assert status in BUSY and "FAILURE" not in steps.values(), (status, steps)
        return runs[0]["runId"] if steps.get(SYNC_OP) == "SUCCESS" and steps.get(EMBED_OP) == "IN_PROGRESS" else None

    run_id = wait_until(embedding_step_running, timeout=180, interval=0.5, what="the run's embeddings step")
    synced = scalar(conn, "SELECT count(*) FROM app.documents WHERE status = 'current'")
    assert synced == before + LATE_DOCS, "the run's sync is done: its embeddings step waits for the workers"
    # The daemon sees the server gone either way: a sensor tick that cannot reach it, or (when its
    # workspace reloads first) the location failing to load, after which it ticks none of its sensors.
    unreachable = (
        "Unable to reach the user code server for sensor",
        "Error loading repository location pipeline_assets",
    )

    def daemon_failures() -> int:
        log = topo.log_tail("daemon", lines=10**6)
        return sum(log.count(line) for line in unreachable)

    failed_before = daemon_failures()
    code = topo.services["code"]
    code.send_signal(9)
    code.wait(timeout=30)
    killed_at = time.monotonic()
    wait_until(
        lambda: daemon_failures() > failed_before,
        timeout=120,
        interval=1,
        what="the daemon to fail to reach the code server while it is down",
    )
    assert run_steps(topo, run_id)[0] == "STARTED", "the run is in progress while the code server is down"
    restarted = time.time()
    topo.start_code_server()
    workers = [topo.start_worker(topo.worker_hosts[0], "pipeline")]  # one host embeds the few late ones
    try:
        wait_current_and_ready(topo, conn, before + LATE_DOCS, workers, timeout=420)
        converged = time.monotonic() - killed_at

        def run_ended() -> str | None:
            status = run_steps(topo, run_id)[0]
            return None if status in BUSY else status

        ended = wait_until(run_ended, timeout=180, interval=0.5, what="the killed run to end")
        assert ended == "SUCCESS", (ended, topo.log_tail("daemon"))
        wait_until(lambda: location_loaded(topo), timeout=180, interval=1, what="the webserver to reload the location")
        ui_back = time.monotonic() - killed_at
        # The whole deployment is back, the daemon too (its workspace is its own): its sensors tick
        # through the restarted code server, and the backfill below can load the location.
        wait_until(
            lambda: sensor_ticked_since(topo, restarted),
            timeout=180,
            interval=1,
            what="a sensor tick of the daemon through the restarted code server",
        )
        FIGURES["code_server_killed"] = {
            "run": SYNC_EMBED_JOB_NAME,
            "converged_s": round(converged, 1),
            "ui_location_back_s": round(ui_back, 1),
            "daemon_back_s": round(time.monotonic() - killed_at, 1),
            "load": load(),
        }
    finally:
        topo.stop_workers(workers)
    new_runs = [r for r in graphql_runs(topo, SOURCE_SENSOR) if r["runId"] not in known]
    assert [(r["runId"], r["status"]) for r in new_runs] == [(run_id, "SUCCESS")], "no relaunch or retry"
    others = [r for r in graphql_runs(topo) if r["runId"] not in known and r["runId"] != run_id]
    assert all(r["jobName"] != RECONCILE_JOB_NAME and r["status"] == "SUCCESS" for r in others), others
    assert_vectors(conn)
    billed = billed_for(topo, "late")
    assert len(billed) == LATE_DOCS and set(billed.values()) == {1}, "every new input billed once"
    conn.close()


def test_backfill_launched_through_the_webserver_graphql(topo):
    """A backfill of every bucket of documents and chunks launched through the webserver's GraphQL
    (as the UI does): its runs succeed on the code host and, nothing having changed, bill nothing."""
    from pipeline_assets.defs.partitions import bucket_key

    conn = main_conn(topo)
    wait_until(lambda: location_loaded(topo), timeout=180, interval=1, what="the code location in the webserver")
    stats_before = topo.provider_stats(brief=False)["billed_by_text"]
    ready_before = counts(conn)
    buckets = int(topo.dagster_env.get("PIPELINE_PARTITION_BUCKETS", "64"))
    every = {"range": {"start": bucket_key(0), "end": bucket_key(buckets - 1)}}
    started = time.monotonic()
    result = topo.graphql(
        """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
             __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }""",
        {
            "p": {
                "partitionsByAssets": [
                    {"assetKey": {"path": ["documents"]}, "partitions": every},
                    {"assetKey": {"path": ["chunks"]}, "partitions": every},
                ]
            }
        },
    )["launchPartitionBackfill"]
    assert result["__typename"] == "LaunchBackfillSuccess", result
    backfill_id = result["backfillId"]

    def finished():
        runs = topo.graphql(
            """query($v: String!) { runsOrError(filter: {tags: [{key: "dagster/backfill",
                                 value: $v}]}) { ... on Runs { results { runId status } } } }""",
            {"v": backfill_id},
        )["runsOrError"]["results"]
        return runs if runs and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs) else None

    runs = wait_until(finished, timeout=300, interval=1, what="the backfill's runs")
    FIGURES["backfill"] = {"runs": len(runs), "seconds": round(time.monotonic() - started, 1), "load": load()}
    assert {r["status"] for r in runs} == {"SUCCESS"}, runs
    assert counts(conn) == ready_before
    assert topo.provider_stats(brief=False)["billed_by_text"] == stats_before, "a no-op backfill bills nothing"
    conn.close()
