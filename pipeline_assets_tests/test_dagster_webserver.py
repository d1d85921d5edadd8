"""`pipeline-assets dev` for real: webserver + daemon on PostgreSQL storage, driven through GraphQL.

One server for the module (start-up is the expensive part): a smoke test that
launches one partition run, and the measurement that a 1,000-partition backfill
launches one run, not 1,000.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

import dagster as dg
import psycopg
import pytest

from pipeline_assets.app import reports
from pipeline_assets.defs.devserver import DAGSTER_URL_ENV, sqlalchemy_url
from pipeline_assets_tests.browser import Browser, chromium_path
from pipeline_assets_tests.conftest import FAKE_DIM, FAKE_MODEL, write_corpus
from pipeline_assets_tests.fake_openai import FakeOpenAI

N_BACKFILL = 1000
REPO_SELECTOR = {"repositoryLocationName": "pipeline_assets", "repositoryName": "__repository__"}
ASSETS = [{"path": ["documents"]}, {"path": ["chunks"]}, {"path": ["embeddings"]}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DevServer:
    def __init__(self, port: int, env: dict, proc: subprocess.Popen, corpus, dagster_home):
        self.port, self.env, self.proc, self.corpus, self.dagster_home = port, env, proc, corpus, dagster_home

    def gql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/graphql", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            data = json.loads(resp.read())
        assert "errors" not in data, data["errors"]
        return data["data"]

    def asset_keys(self) -> set[str]:
        return {"/".join(n["assetKey"]["path"]) for n in self.gql("{ assetNodes { assetKey { path } } }")["assetNodes"]}

    def run_status(self, run_id: str) -> str:
        return self.gql("query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }",
                        {"id": run_id})["runOrError"]["status"]


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited ({proc.returncode}) while waiting for {what}")
        try:
            value = predicate()
        except (urllib.error.URLError, ConnectionError, OSError):
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def dev_server(database_url, server_url, tmp_path_factory):
    base = tmp_path_factory.mktemp("devserver")
    corpus = base / "corpus"
    write_corpus(corpus, N_BACKFILL, words=30)
    dagster_db = "t_dagster_" + uuid.uuid4().hex[:8]
    port = _free_port()
    with FakeOpenAI(dim=FAKE_DIM) as fake:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_")}
        env.update({
            "PIPELINE_DATABASE_URL": database_url, "PIPELINE_HOME": str(base / "home"),
            "PIPELINE_DAGSTER_DATABASE": dagster_db, "PIPELINE_SOURCE_DIR": str(corpus),
            "OPENAI_API_KEY": "test-key", "OPENAI_BASE_URL": fake.base_url,
            "PIPELINE_EMBEDDING_MODEL": FAKE_MODEL, "PIPELINE_CALL_TIMEOUT": "10",
        })
        log = open(base / "server.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-c", f"import sys; from pipeline_assets.defs.devserver import run_dev; "
                                   f"sys.exit(run_dev(port={port}))"],
            env=env, cwd=base, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        server = DevServer(port, env, proc, corpus, base / "home" / "dagster")
        try:
            _wait(lambda: {"documents", "chunks", "embeddings"} <= server.asset_keys(), 90,
                  "the webserver and the code location", proc)
            yield server
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)      # Ctrl-C: run_dev forwards it once
                try:
                    proc.wait(timeout=45)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            log.close()
            print((base / "server.log").read_text()[-3000:])
            with psycopg.connect(server_url, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{dagster_db}" WITH (FORCE)')
    assert proc.returncode == 0, f"run_dev exited {proc.returncode}"
    assert "Dagster stopped." in (base / "server.log").read_text()


def _materialize_partition(server: DevServer, key: str) -> str:
    """Add a partition and launch the embed job for it through GraphQL, as the UI does; its run id."""
    added = server.gql(
        """mutation($repo: RepositorySelector!, $key: String!) {
             addDynamicPartition(repositorySelector: $repo, partitionsDefName: "documents", partitionKey: $key) {
               __typename ... on AddDynamicPartitionSuccess { partitionKey }
               ... on DuplicateDynamicPartitionError { partitionName } ... on PythonError { message } } }""",
        {"repo": REPO_SELECTOR, "key": key})["addDynamicPartition"]
    assert added["__typename"] in ("AddDynamicPartitionSuccess", "DuplicateDynamicPartitionError"), added
    launched = server.gql(
        """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
             __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }""",
        {"p": {"selector": {**REPO_SELECTOR, "jobName": "embed_documents"},
               "executionMetadata": {"tags": [{"key": "dagster/partition", "value": key}]}}})["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    status = _wait(lambda: (st := server.run_status(run_id)) in ("SUCCESS", "FAILURE", "CANCELED") and st,
                   60, "the partition run", server.proc)
    assert status == "SUCCESS"
    return run_id


def test_webserver_smoke_graphql_asset_graph_and_one_partition_run(dev_server, database_url):
    started = time.monotonic()
    assert {"documents", "chunks", "embeddings"} <= dev_server.asset_keys()
    _materialize_partition(dev_server, "doc0000.md")
    with psycopg.connect(database_url) as conn:
        (doc,) = reports.document_summaries(conn, str(dev_server.corpus.resolve()), ["doc0000.md"]).values()
        _, cov = reports.embedding_coverage(conn, str(dev_server.corpus.resolve()), ["doc0000.md"],
                                            f"openai/{FAKE_MODEL}")
    assert doc.status == "current" and cov.wanted == cov.ready == doc.chunks
    assert time.monotonic() - started < 60


@pytest.mark.skipif(chromium_path() is None, reason="no Chromium on this machine (.ci/run installs Debian's "
                                                    "chromium; elsewhere: apt-get install chromium)")
def test_ui_in_headless_chromium_shows_the_assets_and_the_run_metadata(dev_server, database_url):
    """The user's path, in a real browser: the asset graph shows the three assets, and the page of
    the partition just materialized shows that run and the metadata the asset reported."""
    key = "doc0001.md"
    run_id = _materialize_partition(dev_server, key)
    with psycopg.connect(database_url) as conn:
        _, cov = reports.embedding_coverage(conn, str(dev_server.corpus.resolve()), [key], f"openai/{FAKE_MODEL}")
    base = f"http://127.0.0.1:{dev_server.port}"
    with Browser() as browser:
        browser.open(f"{base}/asset-groups/embedding_pipeline")
        graph = browser.wait_for_text("documents", "chunks", "embeddings", "Materialize all")
        assert "embedding_store" in graph
        browser.open(f"{base}/assets/embeddings?view=partitions&partition={urllib.parse.quote(key, safe='')}")
        page = browser.wait_for_text("Latest materialization", run_id[:8], "Metadata")
    metadata = " ".join(page.split("Metadata", 1)[1].split())
    assert cov.wanted == cov.ready > 0
    for name, value in (("chunks", cov.wanted), ("ready", cov.ready), ("failed", 0)):
        assert re.search(rf"\b{name} {value}\b", metadata), f"{name}={value} not in {metadata[:300]}"


def test_backfill_of_1000_partitions_is_one_run(dev_server, database_url, monkeypatch):
    keys = [f"doc{i:04d}.md" for i in range(N_BACKFILL)]
    dagster_db = dev_server.env["PIPELINE_DAGSTER_DATABASE"]
    monkeypatch.setenv(DAGSTER_URL_ENV, sqlalchemy_url(psycopg.conninfo.make_conninfo(database_url,
                                                                                     dbname=dagster_db)))
    instance = dg.DagsterInstance.from_config(str(dev_server.dagster_home))   # the real instance
    try:
        instance.add_dynamic_partitions("documents", keys)
        assert len(instance.get_dynamic_partitions("documents")) == N_BACKFILL
    finally:
        instance.dispose()

    started = time.monotonic()
    result = dev_server.gql(
        """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
             __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }""",
        {"p": {"partitionNames": keys, "assetSelection": ASSETS}})["launchPartitionBackfill"]
    assert result["__typename"] == "LaunchBackfillSuccess", result
    backfill_id = result["backfillId"]
    runs_query = """query($id: String!) { runsOrError(filter: {tags: [{key: "dagster/backfill", value: $id}]}) {
                      ... on Runs { results { runId status startTime endTime } } } }"""

    def finished_runs():
        runs = dev_server.gql(runs_query, {"id": backfill_id})["runsOrError"]["results"]
        done = runs and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs)
        return runs if done else None

    runs = _wait(finished_runs, 150, "the backfill's runs", dev_server.proc, interval=1.0)
    wall = time.monotonic() - started
    run_seconds = sum(r["endTime"] - r["startTime"] for r in runs)
    print(f"\nBACKFILL {N_BACKFILL} partitions: runs launched={len(runs)} wall={wall:.1f}s "
          f"(run time {run_seconds:.1f}s; the rest is the backfill daemon's 30 s cadence and run start)")
    assert len(runs) == 1 and runs[0]["status"] == "SUCCESS"
    with psycopg.connect(database_url) as conn:
        root = str(dev_server.corpus.resolve())
        summaries = reports.document_summaries(conn, root, keys)
        _, cov = reports.embedding_coverage(conn, root, keys, f"openai/{FAKE_MODEL}")
    assert len(summaries) == N_BACKFILL and all(s.status == "current" for s in summaries.values())
    assert cov.wanted == cov.ready > 0


def test_source_sensor_through_the_daemon_launches_one_batched_run(dev_server):
    """The sensor daemon accepts the partition-range RunRequest: one run for the whole corpus."""
    started = dev_server.gql(
        """mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) {
             __typename ... on Sensor { sensorState { status } } ... on PythonError { message } } }""",
        {"s": {**REPO_SELECTOR, "sensorName": "source_documents"}})["startSensor"]
    assert started["__typename"] == "Sensor", started
    runs_query = """{ runsOrError(filter: {tags: [{key: "pipeline/trigger", value: "source_documents"}]}) {
                       ... on Runs { results { runId status tags { key value } } } } }"""

    def finished_runs():
        runs = dev_server.gql(runs_query)["runsOrError"]["results"]
        return runs if runs and all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in runs) else None

    runs = _wait(finished_runs, 90, "the sensor's run", dev_server.proc, interval=1.0)
    assert len(runs) == 1 and runs[0]["status"] == "SUCCESS", runs
    tags = {t["key"]: t["value"] for t in runs[0]["tags"]}
    assert tags["dagster/asset_partition_range_start"] == "doc0000.md"
    assert tags["dagster/asset_partition_range_end"] == f"doc{N_BACKFILL - 1:04d}.md"
    assert tags["dagster/run_key"].startswith(f"batch@g0:{N_BACKFILL}:")
