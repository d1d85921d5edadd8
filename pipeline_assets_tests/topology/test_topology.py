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

from pipeline_assets_tests.conftest import LONG_PROFILE
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.processes import REPO, wait_until
from pipeline_assets_tests.topology.scenarios import (
    FIGURES,
    MODEL_ID,
    assert_vectors,
    billed_for,
    counts,
    graphql_runs,
    load,
    location_loaded,
    main_conn,
    scalar,
    sensor_ticked_since,
    wait_current_and_ready,
)
from pipeline_assets_tests.topology.services import missing_requirements

_why_not = missing_requirements()
pytestmark = [pytest.mark.skipif(_why_not is not None, reason=_why_not or ""), pytest.mark.timeout(900)]

# Every bucket holds documents from a few hundred on; the short profile's 1,000 keep each worker host
# busy, and each 5 s tick of the source sensor lists a fifth of the files (the ticks run for the whole
# module). The long profile keeps the 5,000-document corpus.
CORPUS_DOCS = 5000 if LONG_PROFILE else 1000


# ---- scenarios ----------------------------------------------------------------------------------
def test_corpus_made_current_by_the_sensor_and_embedded_by_the_worker_hosts(topo):
    """CORPUS_DOCS documents dropped in the watched directory: the source sensor (code host, via the
    daemon) brings every bucket current, the three worker hosts embed every chunk through PgBouncer,
    every input billed once; `status` agrees with the database, the Dagster runs succeeded."""
    write_corpus(topo.source, CORPUS_DOCS, prefix="corpus", words=40)
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
        runs = graphql_runs(topo)
        busy = [r for r in runs if r["status"] in ("QUEUED", "NOT_STARTED", "STARTING", "STARTED")]
        return None if busy or not runs else runs

    runs = wait_until(runs_settled, timeout=240, interval=1, what="the Dagster runs to finish")
    assert {r["status"] for r in runs} == {"SUCCESS"}, runs
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
    """The code server (where runs execute) SIGKILLed while a sensor-launched run is in progress,
    then started again, as a supervisor would: the next sensor tick (or the failed run's retry)
    converges; every new document current and embedded, every input billed once."""
    conn = main_conn(topo)
    before = scalar(conn, "SELECT count(*) FROM app.documents WHERE status = 'current'")
    known = {r["runId"] for r in graphql_runs(topo)}
    write_corpus(topo.source / "late", 300, prefix="late", words=40)
    workers = [topo.start_worker(h, "pipeline") for h in topo.worker_hosts]
    try:

        def a_new_run_started():
            return [r for r in graphql_runs(topo) if r["runId"] not in known and r["status"] == "STARTED"]

        running = wait_until(a_new_run_started, timeout=180, interval=0.2, what="a sensor run to start")
        code = topo.services["code"]
        code.send_signal(9)
        code.wait(timeout=30)
        killed_at = time.monotonic()
        time.sleep(2)  # the supervisor's restart delay
        restarted = time.time()
        topo.start_code_server()
        wait_current_and_ready(topo, conn, before + 300, workers, timeout=420)
        converged = time.monotonic() - killed_at
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
            "run": running[0]["jobName"],
            "converged_s": round(converged, 1),
            "ui_location_back_s": round(ui_back, 1),
            "daemon_back_s": round(time.monotonic() - killed_at, 1),
            "load": load(),
        }
    finally:
        topo.stop_workers(workers)
    assert_vectors(conn)
    billed = billed_for(topo, "late")
    assert len(billed) == 300 and set(billed.values()) == {1}, "every new input billed once"
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
