"""`pipeline-assets dev` for real: webserver + daemon on PostgreSQL storage, driven through GraphQL.

One server for the module (start-up is the expensive part), over a corpus of 60 documents in 10
document buckets (1,000 in the product's 64 with PIPELINE_TEST_PROFILE=long): a smoke test that launches one
bucket run (and the daemon's embeddings run after it), the partition's page in a browser, a
second model's column and a backfill of every bucket x both models that launches three runs
(documents and chunks by bucket; embeddings by bucket, one per model), not one per cell, the source
sensor through the daemon, and that what the UI shows per partition (counts, FRESH/STALE) agrees
with `status --json` and with the files on disk. The fixture stops the source sensor (and the
sensors no test here uses) before the corpus is written, so each test decides what runs.
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
from collections import Counter

import dagster as dg
import psycopg
import pytest

from pipeline_assets.cli.dagster_instance import DAGSTER_URL_ENV, sqlalchemy_url
from pipeline_assets.store import reports
from pipeline_assets_tests.browser import Browser, chromium_path
from pipeline_assets_tests.conftest import FAKE_DIM, FAKE_MODEL, FAKE_WINDOW, LONG_PROFILE, TEST_BUCKETS
from pipeline_assets_tests.dagster_helpers import bucket_keys, bucket_of
from pipeline_assets_tests.dagster_instances import copy_of_dagster_template
from pipeline_assets_tests.data_helpers import write_corpus
from pipeline_assets_tests.fake_openai import FakeOpenAI
from pipeline_assets_tests.processes import cli, stop_group

# What is tested holds for any bucket count and corpus size as long as every bucket holds documents
# (10 buckets: from 40 documents on): one backfill run, not one per bucket, and per-bucket materializations and
# checks whose counts add up. The long profile keeps the 1,000-document corpus.
N = 64 if LONG_PROFILE else TEST_BUCKETS
N_DOCUMENTS = 1000 if LONG_PROFILE else 60
BUCKETS = bucket_keys(N)
DOCS = [f"doc{i:04d}.md" for i in range(N_DOCUMENTS)]
MODEL = f"openai/{FAKE_MODEL}"
REPO_SELECTOR = {"repositoryLocationName": "pipeline_assets", "repositoryName": "__repository__"}
SOURCE_SENSOR = {**REPO_SELECTOR, "sensorName": "source_documents"}
ASSETS = [{"path": ["documents"]}, {"path": ["chunks"]}, {"path": ["embeddings"]}]
FINISHED = ("SUCCESS", "FAILURE", "CANCELED")
# Sensors no test here exercises (test_dagster_sensors and test_dagster_reconcile evaluate them):
# stopped with the source sensor, so their ticks (every 10 to 60 s for the whole module, each a
# Dagster instance and queries) cost nothing; embed_after_sync and model_switch keep running.
UNUSED_SENSORS = ("rerun_stale_documents", "reconcile_on_dead_letters", "reconcile_on_run_failure")
RUN_TIMEOUT = 300  # seconds: generous, the machine is shared
# A binary file (quarantined) the source sensor's test writes into the bucket the UI test edits.
BLOB = next(f"blob{i}.bin" for i in range(5000) if bucket_of(f"blob{i}.bin", N) == bucket_of(DOCS[10], N))


# Each test starts several Dagster processes (each imports Dagster: tens of seconds on a loaded
# machine): a generous deadline against a hang.
pytestmark = pytest.mark.timeout(900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DevServer:
    def __init__(self, port: int, env: dict, proc: subprocess.Popen, corpus, dagster_home):
        self.port, self.env, self.proc, self.corpus, self.dagster_home = port, env, proc, corpus, dagster_home

    def gql(self, query: str, variables: dict | None = None) -> dict:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/graphql", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            data = json.loads(resp.read())
        assert "errors" not in data, data["errors"]
        return data["data"]

    def asset_keys(self) -> set[str]:
        return {"/".join(n["assetKey"]["path"]) for n in self.gql("{ assetNodes { assetKey { path } } }")["assetNodes"]}

    def run_status(self, run_id: str) -> str:
        return self.gql("query($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }", {"id": run_id})[
            "runOrError"
        ]["status"]

    def sensor(self, name: str = SOURCE_SENSOR["sensorName"]) -> dict:
        return self.gql(
            """query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) {
                             ... on Sensor { id sensorState { status ticks(limit: 10) { status timestamp } } } } }""",
            {"s": {**REPO_SELECTOR, "sensorName": name}},
        )["sensorOrError"]

    def sensor_ticks(self) -> list[dict]:
        return self.sensor()["sensorState"]["ticks"]

    def stop_sensor(self, name: str = SOURCE_SENSOR["sensorName"]) -> None:
        """Stop a sensor (RUNNING by default) and wait until no tick of it is in progress."""
        stopped = self.gql(
            """mutation($id: String!) { stopSensor(id: $id) { __typename
                                ... on StopSensorMutationResult { instigationState { status } } } }""",
            {"id": self.sensor(name)["id"]},
        )["stopSensor"]
        assert stopped["__typename"] == "StopSensorMutationResult", stopped

        def stopped_and_idle() -> bool:
            state = self.sensor(name)["sensorState"]
            return state["status"] == "STOPPED" and all(t["status"] != "STARTED" for t in state["ticks"])

        _wait(stopped_and_idle, 60, f"the {name} sensor to stop", self.proc)


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
    corpus.mkdir()  # empty until the source sensor is stopped
    # Dagster's storage database is a copy of one that already holds Dagster's schema (creating its
    # tables is seconds of the server's CPU); `dev` on a fresh database is what test_dagster_commands'
    # dagster-env test covers (the same `prepare`).
    dagster_db = copy_of_dagster_template(server_url)
    port = _free_port()
    with FakeOpenAI(dim=FAKE_DIM) as fake:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_")}
        env.update(
            {
                "PIPELINE_DATABASE_URL": database_url,
                "PIPELINE_HOME": str(base / "home"),
                "PIPELINE_DAGSTER_DATABASE": dagster_db,
                "PIPELINE_SOURCE_DIR": str(corpus),
                "OPENAI_API_KEY": "test-key",
                "OPENAI_BASE_URL": fake.base_url,
                "PIPELINE_EMBEDDING_MODEL": FAKE_MODEL,
                "PIPELINE_MODEL_MAX_INPUT_TOKENS": str(FAKE_WINDOW),
                "PIPELINE_CALL_TIMEOUT": "10",
                # No scheduled reconciliation during the module (it would ingest the whole source).
                "PIPELINE_RECONCILE_CRON": "0 0 1 1 *",
                # The source sensor ticks every 5 s (the daemon's own loop), not 30: the sensor test
                # waits for a tick that requests the run and for one after it ends.
                "PIPELINE_SOURCE_SENSOR_INTERVAL": "5",
            }
        )
        env["PIPELINE_PARTITION_BUCKETS"] = str(N)
        log = open(base / "server.log", "w")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import sys; from pipeline_assets.cli.devserver import run_dev; sys.exit(run_dev(port={port}))",
            ],
            env=env,
            cwd=base,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        server = DevServer(port, env, proc, corpus, base / "home" / "dagster")
        try:
            _wait(
                lambda: {"documents", "chunks", "embeddings"} <= server.asset_keys(),
                300,
                "the webserver and the code location",
                proc,
            )
            for name in (SOURCE_SENSOR["sensorName"], *UNUSED_SENSORS):
                server.stop_sensor(name)
            write_corpus(corpus, N_DOCUMENTS, words=30)
            yield server
        finally:
            stop_group(proc, signal.SIGINT, grace=45)  # Ctrl-C: run_dev forwards it once
            log.close()
            print((base / "server.log").read_text()[-3000:])
            with psycopg.connect(server_url, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{dagster_db}" WITH (FORCE)')
    assert proc.returncode == 0, f"run_dev exited {proc.returncode}"
    assert "Dagster stopped." in (base / "server.log").read_text()


def _wait_run(server: DevServer, run_id: str, what: str) -> None:
    status = _wait(lambda: (st := server.run_status(run_id)) in FINISHED and st, RUN_TIMEOUT, what, server.proc)
    assert status == "SUCCESS", (what, status)


def _runs_tagged(server: DevServer, key: str, value: str) -> list[dict]:
    return server.gql(
        """query($k: String!, $v: String!) { runsOrError(filter: {tags: [{key: $k, value: $v}]}) {
                           ... on Runs { results { runId status jobName startTime endTime tags { key value } } } } }""",
        {"k": key, "v": value},
    )["runsOrError"]["results"]


def _materialize_bucket(server: DevServer, key: str) -> tuple[str, str]:
    """Launch the bucket run of one bucket through GraphQL, as the UI's launchpad does, and wait for
    the embeddings run the daemon's embed_after_sync sensor launches after it; their run ids."""
    launched = server.gql(
        """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) {
             __typename ... on LaunchRunSuccess { run { runId } } ... on PythonError { message } } }""",
        {
            "p": {
                "selector": {**REPO_SELECTOR, "jobName": "sync_documents"},
                "executionMetadata": {"tags": [{"key": "dagster/partition", "value": key}]},
            }
        },
    )["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]
    _wait_run(server, run_id, "the bucket run")
    (embed,) = _wait(
        lambda: _runs_tagged(server, "pipeline/after_run", run_id),
        RUN_TIMEOUT,
        "the embeddings run after the bucket run",
        server.proc,
        interval=1.0,
    )
    assert embed["jobName"] == "embed_documents"
    _wait_run(server, embed["runId"], "the embeddings run")
    return run_id, embed["runId"]


def _latest_metadata(server: DevServer, asset: str, keys: list[str]) -> dict[str, tuple[str, dict]]:
    """Per partition, (run id, metadata) of its latest materialization, as the UI reads them (a bucket
    key of embeddings: that bucket x the model)."""
    if asset == "embeddings":
        return {
            k.split("|")[0]: v
            for k, v in _latest_metadata(server, "embeddings_", [f"{k}|{MODEL}" for k in keys]).items()
        }
    asset = asset.rstrip("_")
    data = server.gql(
        """query($a: AssetKeyInput!, $p: [String!]) { assetNodeOrError(assetKey: $a) { ... on AssetNode {
             latestMaterializationByPartition(partitions: $p) { partition runId metadataEntries { label
               ... on IntMetadataEntry { intValue } ... on TextMetadataEntry { text }
               ... on FloatMetadataEntry { floatValue } } } } } }""",
        {"a": {"path": [asset]}, "p": keys},
    )["assetNodeOrError"]["latestMaterializationByPartition"]
    return {
        e["partition"]: (
            e["runId"],
            {m["label"]: m.get("intValue", m.get("text", m.get("floatValue"))) for m in e["metadataEntries"]},
        )
        for e in data
        if e
    }


def _bucket_docs(key: str) -> list[str]:
    return [d for d in DOCS if bucket_of(d, N) == key]


@pytest.fixture(scope="module")
def bucket_run(dev_server) -> tuple[str, str, str]:
    """(bucket key, bucket run id, embeddings run id) of one bucket materialized through GraphQL: the
    smoke test checks the runs, the browser test the page that shows them (one pair for both; each
    run starts a process)."""
    key = bucket_of(DOCS[0], N)
    return key, *_materialize_bucket(dev_server, key)


def test_webserver_smoke_graphql_asset_graph_and_one_bucket_run(dev_server, database_url, bucket_run):
    assert {"documents", "chunks", "embeddings", "embedding_store", "reconciliation"} <= dev_server.asset_keys()
    key, run_id, embed_run_id = bucket_run
    members = _bucket_docs(key)
    assert 1 < len(members) < N_DOCUMENTS // 2  # a bucket is a slice of the corpus (~1/N of it)
    root = str(dev_server.corpus.resolve())
    with psycopg.connect(database_url) as conn:
        # The run brought exactly its bucket's documents current and embedded, nothing else.
        ingested = sorted(r[0] for r in conn.execute("SELECT document_id FROM app.documents"))
        summaries = reports.document_summaries(conn, root, members)
        per_doc, cov = reports.embedding_coverage(conn, root, members, MODEL)
    assert ingested == members and all(s.status == "current" for s in summaries.values())
    assert cov.wanted == cov.ready == sum(s.chunks for s in summaries.values()) > 0
    # What the UI shows for that partition: this run, the bucket's counts.
    ((run, documents),) = _latest_metadata(dev_server, "documents", [key]).values()
    assert run == run_id and (documents["documents"], documents["current"]) == (len(members), len(members))
    ((run, embeddings),) = _latest_metadata(dev_server, "embeddings", [key]).values()
    assert run == embed_run_id
    assert (embeddings["chunks"], embeddings["ready"], embeddings["failed"]) == (
        sum(c.wanted for c in per_doc.values()),
        sum(c.ready for c in per_doc.values()),
        0,
    )


@pytest.mark.skipif(
    chromium_path() is None,
    reason="no Chromium on this machine (.ci/run installs Debian's chromium; elsewhere: apt-get install chromium)",
)
def test_ui_in_headless_chromium_shows_the_assets_and_the_run_metadata(dev_server, database_url, bucket_run):
    """The user's path, in a real browser: the asset graph shows the three assets, and the page of
    the bucket materialized through GraphQL shows that run and the metadata the asset reported for it."""
    key, _, run_id = bucket_run
    members = _bucket_docs(key)
    with psycopg.connect(database_url) as conn:
        per_doc, _ = reports.embedding_coverage(conn, str(dev_server.corpus.resolve()), members, MODEL)
    chunks, ready = sum(c.wanted for c in per_doc.values()), sum(c.ready for c in per_doc.values())
    assert sorted(per_doc) == members and chunks == ready > 0
    base = f"http://127.0.0.1:{dev_server.port}"
    with Browser() as browser:
        browser.open(f"{base}/asset-groups/embedding_pipeline")
        graph = browser.wait_for_text("documents", "chunks", "embeddings", "Materialize all")
        assert "embedding_store" in graph
        partition = f"{key}|{MODEL}"  # bucket x model
        browser.open(f"{base}/assets/embeddings?view=partitions&partition={urllib.parse.quote(partition, safe='')}")
        page = browser.wait_for_text("Latest materialization", run_id[:8], "Metadata", key)
    metadata = " ".join(page.split("Metadata", 1)[1].split())
    for name, value in (("chunks", chunks), ("ready", ready), ("failed", 0), ("documents", len(members))):
        assert re.search(rf"\b{name} {value}\b", metadata), f"{name}={value} not in {metadata[:300]}"


def _add_second_model(server: DevServer, database_url: str) -> str:
    """`models add` of a second model (the registry only); its id once the daemon's sensors have
    made it a column of embeddings (a key of the model dimension, after the configured model's)."""
    from pipeline_assets.app import model_admin
    from pipeline_assets.settings import Settings
    from pipeline_assets.store import db

    settings = Settings.from_env().replace(
        database_url=database_url,
        openai_api_key="test-key",
        openai_base_url=server.env["OPENAI_BASE_URL"],
        model_max_input_tokens=FAKE_WINDOW,
    )
    with db.make_pool(database_url, max_size=2) as pool:
        added = model_admin.add(settings, pool, "fake-embed-2")["model_id"]
    keys_q = """{ assetNodeOrError(assetKey: {path: ["embeddings"]}) { ... on AssetNode {
                  partitionKeysByDimension { name partitionKeys } } } }"""

    def model_keys():
        dims = server.gql(keys_q)["assetNodeOrError"]["partitionKeysByDimension"]
        keys = next(d["partitionKeys"] for d in dims if d["name"] == "model")
        return keys if added in keys else None

    models = _wait(model_keys, RUN_TIMEOUT, "the new model's column", server.proc, interval=1.0)
    assert models == [MODEL, added]
    return added


def test_backfill_of_every_bucket_and_two_model_columns_is_three_runs(dev_server, database_url, monkeypatch):
    """The UI's backfill of the three assets over every bucket and both models (a second one added
    by `models add` gets its column from the daemon's sensors): one run of documents and chunks over
    the buckets, then one of embeddings per model over the buckets x that model
    (BackfillPolicy.single_run on a multi-partitioned asset groups the subset by its smaller
    dimension), not one per bucket or cell; each model's vectors for every chunk, per-bucket metadata that adds up."""
    added = _add_second_model(dev_server, database_url)
    started = time.monotonic()
    every = {"range": {"start": BUCKETS[0], "end": BUCKETS[-1]}}
    result = dev_server.gql(
        """mutation($p: LaunchBackfillParams!) { launchPartitionBackfill(backfillParams: $p) {
             __typename ... on LaunchBackfillSuccess { backfillId } ... on PythonError { message } } }""",
        {
            "p": {
                "partitionsByAssets": [
                    {"assetKey": {"path": ["documents"]}, "partitions": every},
                    {"assetKey": {"path": ["chunks"]}, "partitions": every},
                    {
                        "assetKey": {"path": ["embeddings"]},
                        "partitions": {"range": {"start": f"{BUCKETS[0]}|{MODEL}", "end": f"{BUCKETS[-1]}|{added}"}},
                    },
                ]
            }
        },
    )["launchPartitionBackfill"]
    assert result["__typename"] == "LaunchBackfillSuccess", result
    backfill_id = result["backfillId"]

    def finished_runs():
        runs = _runs_tagged(dev_server, "dagster/backfill", backfill_id)
        done = len(runs) == 3 and all(r["status"] in FINISHED for r in runs)
        return runs if done else None

    runs = _wait(finished_runs, 2 * RUN_TIMEOUT, "the backfill's runs", dev_server.proc, interval=1.0)
    wall = time.monotonic() - started
    run_seconds = sum(r["endTime"] - r["startTime"] for r in runs)
    print(
        f"\nBACKFILL {len(BUCKETS)} buckets x 2 models, {N_DOCUMENTS} documents: runs launched={len(runs)} "
        f"wall={wall:.1f}s (run time {run_seconds:.1f}s; the rest is the backfill daemon and run start)"
    )
    assert [r["status"] for r in runs] == ["SUCCESS"] * 3
    sync_id = _latest_metadata(dev_server, "documents", BUCKETS[:1])[BUCKETS[0]][0]
    ranges = {
        r["runId"]: (t["dagster/asset_partition_range_start"], t["dagster/asset_partition_range_end"])
        for r in runs
        for t in [{x["key"]: x["value"] for x in r["tags"]}]
    }
    assert ranges[sync_id] == (BUCKETS[0], BUCKETS[-1])
    embed_runs = {m: run for run, (first, last) in ranges.items() for m in (MODEL, added) if first.endswith(f"|{m}")}
    assert {m: ranges[run] for m, run in embed_runs.items()} == {
        m: (f"{BUCKETS[0]}|{m}", f"{BUCKETS[-1]}|{m}") for m in (MODEL, added)
    }
    root = str(dev_server.corpus.resolve())
    with psycopg.connect(database_url) as conn:
        summaries = reports.document_summaries(conn, root, DOCS)
        per_doc, cov = reports.embedding_coverage(conn, root, DOCS, MODEL)
        _, cov_added = reports.embedding_coverage(conn, root, DOCS, added)
    assert len(summaries) == N_DOCUMENTS and all(s.status == "current" for s in summaries.values())
    assert cov.wanted == cov.ready > 0 and cov_added.wanted == cov_added.ready == cov.wanted
    # Every bucket has a materialization of that one run, with its own counts: they add up to the corpus.
    expected = Counter(bucket_of(d, N) for d in DOCS)
    documents = _latest_metadata(dev_server, "documents", BUCKETS)
    assert sorted(documents) == BUCKETS and {r for r, _ in documents.values()} == {sync_id}
    assert {k: m["documents"] for k, (_, m) in documents.items()} == {k: expected[k] for k in BUCKETS}
    chunks_by_bucket = Counter()
    for doc, c in per_doc.items():
        chunks_by_bucket[bucket_of(doc, N)] += c.wanted
    for model in (MODEL, added):
        cells = _latest_metadata(dev_server, "embeddings_", [f"{k}|{model}" for k in BUCKETS])
        assert {c: r for c, (r, _) in cells.items()} == {f"{k}|{model}": embed_runs[model] for k in BUCKETS}, model
        assert {c.split("|")[0]: (m["chunks"], m["ready"]) for c, (_, m) in cells.items()} == {
            k: (chunks_by_bucket[k], chunks_by_bucket[k]) for k in BUCKETS
        }, model
    # One coverage evaluation per bucket of each embeddings run, all passed: one per bucket, never one per document.
    dagster_db = dev_server.env["PIPELINE_DAGSTER_DATABASE"]
    monkeypatch.setenv(DAGSTER_URL_ENV, sqlalchemy_url(psycopg.conninfo.make_conninfo(database_url, dbname=dagster_db)))
    instance = dg.DagsterInstance.from_config(str(dev_server.dagster_home))  # the real instance
    try:
        evaluations = {
            model: [
                e.dagster_event.event_specific_data
                for e in instance.all_logs(run, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
            ]
            for model, run in embed_runs.items()
        }
    finally:
        instance.dispose()
    for model, found in evaluations.items():
        assert sorted(e.partition for e in found) == [f"{k}|{model}" for k in BUCKETS], model
        assert all(e.passed for e in found), model


def test_source_sensor_through_the_daemon_launches_one_run_over_the_changed_buckets(dev_server, database_url):
    """The sensor daemon accepts the partition-range RunRequest: one run over the span of the buckets
    of the changed, new and deleted documents, bringing exactly those documents current (and
    quarantining a new binary file, whose bucket the UI test below then finds synced by this run)."""
    edited, deleted, added, blob = DOCS[5], DOCS[6], f"doc{N_DOCUMENTS:04d}.md", BLOB
    corpus = dev_server.corpus
    (corpus / edited).write_text("# edited\n\nwords this document never had before today\n")
    (corpus / deleted).unlink()
    (corpus / added).write_text("# added\n\na document written while the sensor was stopped\n")
    (corpus / blob).write_bytes(b"\x00\x01binary\x00" * 64)  # quarantined: unsupported_binary
    changed_buckets = sorted({bucket_of(d, N) for d in (edited, deleted, added, blob)})
    started = dev_server.gql(
        """mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) {
             __typename ... on Sensor { sensorState { status } } ... on PythonError { message } } }""",
        {"s": SOURCE_SENSOR},
    )["startSensor"]
    assert started["__typename"] == "Sensor", started

    def finished_runs():  # the bucket run and the embeddings run after it (which keeps its trigger tag)
        runs = _runs_tagged(dev_server, "pipeline/trigger", "source_documents")
        return runs if len(runs) >= 2 and all(r["status"] in FINISHED for r in runs) else None

    runs = _wait(finished_runs, 2 * RUN_TIMEOUT, "the sensor's runs", dev_server.proc, interval=1.0)
    # A tick after the runs ended skips: nothing else pending, so that bucket run was the only one.
    ended = max(r["endTime"] for r in runs)
    _wait(
        lambda: any(t["status"] == "SKIPPED" and t["timestamp"] > ended for t in dev_server.sensor_ticks()),
        RUN_TIMEOUT,
        "a sensor tick after the runs",
        dev_server.proc,
        interval=1.0,
    )
    runs = _runs_tagged(dev_server, "pipeline/trigger", "source_documents")
    assert sorted(r["jobName"] for r in runs) == ["embed_documents", "sync_documents"], runs
    assert all(r["status"] == "SUCCESS" for r in runs), runs
    by_job = {r["jobName"]: r for r in runs}
    sync, embed = by_job["sync_documents"], by_job["embed_documents"]
    print(
        f"\nSOURCE CHANGE: bucket run {sync['endTime'] - sync['startTime']:.1f}s, the embeddings run started "
        f"{embed['startTime'] - sync['endTime']:.1f}s after it ended and took "
        f"{embed['endTime'] - embed['startTime']:.1f}s"
    )
    runs = [sync]
    tags = {t["key"]: t["value"] for t in runs[0]["tags"]}
    first, last = tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]
    assert first <= changed_buckets[0] and changed_buckets[-1] <= last
    assert tags["dagster/run_key"].startswith("sync@g0:")
    # The run ingested exactly the three new or changed files and tombstoned the deleted one; the
    # prefilter kept it from reading any unchanged file (it reads a changed one again only if the
    # sensor's tick hashed it within the racy-mtime window: 0 to 3, depending on when the tick came).
    for key in (bucket_of(added, N), bucket_of(blob, N)):
        ((run, meta),) = _latest_metadata(dev_server, "documents", [key]).values()
        assert run == runs[0]["runId"], key
    assert (meta["changed_documents"], meta["gone_documents"]) == (3, 1) and meta["files_read"] <= 3
    root = str(corpus.resolve())
    with psycopg.connect(database_url) as conn:
        summaries = reports.document_summaries(conn, root, [edited, deleted, added, blob])
        _, cov = reports.embedding_coverage(conn, root, [edited, added], MODEL)
        edited_text = conn.execute(
            """SELECT c.text FROM app.chunks c JOIN app.documents d USING (doc_pk)
                                      WHERE d.document_id = %s AND d.status = 'current'""",
            (edited,),
        ).fetchall()
    assert summaries[deleted].status == "deleted" and summaries[blob].status == "quarantined"
    assert summaries[edited].status == summaries[added].status == "current"
    assert any("never had before today" in t for (t,) in edited_text)
    assert cov.wanted == cov.ready > 0


def _stale_status(server: DevServer, asset: str, partition: str) -> tuple[str, list[str]]:
    """What the UI's partition view shows (its AssetPartitionStaleQuery): FRESH, STALE or MISSING,
    and the stale causes' reasons."""
    node = server.gql(
        """query($a: AssetKeyInput!, $p: String!) { assetNodeOrError(assetKey: $a) { ... on AssetNode {
             staleStatus(partition: $p) staleCauses(partition: $p) { key { path } partitionKey reason } } } }""",
        {"a": {"path": [asset]}, "p": partition},
    )["assetNodeOrError"]
    return node["staleStatus"], [
        f"{'/'.join(c['key']['path'])} {c['partitionKey']}: {c['reason']}" for c in node["staleCauses"]
    ]


def _sensor_runs_done(server: DevServer, before: set[str]) -> list[dict] | None:
    """The source sensor's run after a change (it syncs and embeds: one run, nothing after it) that is
    not in ``before``, once it has finished."""
    runs = [r for r in _runs_tagged(server, "pipeline/trigger", "source_documents") if r["runId"] not in before]
    jobs = [r["jobName"] for r in runs]
    return runs if jobs == ["sync_and_embed"] and all(r["status"] in FINISHED for r in runs) else None


def _ensure_source_sensor_running(server: DevServer) -> None:
    if server.sensor()["sensorState"]["status"] != "RUNNING":
        started = server.gql(
            """mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) {
                                  __typename ... on PythonError { message } } }""",
            {"s": SOURCE_SENSOR},
        )["startSensor"]
        assert started["__typename"] == "Sensor", started


def _status_json(server: DevServer) -> dict:
    return json.loads(cli("status", "--json", env=server.env).stdout)


def test_ui_partitions_agree_with_status_and_an_edit_is_not_shown_fresh(dev_server, database_url):
    """What the UI shows per partition is true: the counts of the buckets' latest materializations
    add up to what `status --json` says, and a bucket whose document was edited on disk after its
    run is not FRESH once the source sensor has observed the edit (it is again after the run)."""
    edited = DOCS[10]
    key = bucket_of(edited, N)
    corpus = dev_server.corpus
    # The bucket's latest run is the source sensor's of the test above, which quarantined a binary
    # file in it (BLOB, unsupported_binary): shown FRESH, the file named in its metadata.
    sensor_runs = _runs_tagged(dev_server, "pipeline/trigger", "source_documents")
    ((run, meta),) = _latest_metadata(dev_server, "documents", [key]).values()
    assert run in {r["runId"] for r in sensor_runs if r["jobName"] == "sync_documents"}
    assert meta["quarantined"] >= 1 and BLOB in meta["quarantined_ids"]
    assert _stale_status(dev_server, "documents", key)[0] == "FRESH"
    _ensure_source_sensor_running(dev_server)

    # The edit, observed by the sensor; its run is held at its first write to app.documents (a SHARE
    # lock lets the sensor read but no run write), so the partition is seen between the two.
    before = {r["runId"] for r in sensor_runs}
    with psycopg.connect(database_url) as hold:
        hold.execute("LOCK TABLE app.documents IN SHARE MODE")
        (corpus / edited).write_text("# edited for the truth test\n\ntext the run has not read yet\n")

        def requested():
            return [
                r
                for r in _runs_tagged(dev_server, "pipeline/trigger", "source_documents")
                if r["runId"] not in before and r["jobName"] == "sync_and_embed"
            ]

        (held,) = _wait(requested, RUN_TIMEOUT, "the sensor's run for the edit", dev_server.proc, interval=1.0)
        shown, causes = _stale_status(dev_server, "documents", key)
        assert dev_server.run_status(held["runId"]) not in FINISHED
        assert shown == "STALE", f"documents {key} shown {shown} after the edit of {edited} was observed"
        assert causes == [f"source_files {key}: has a new data version"], causes
        for asset, partition in (("chunks", key), ("embeddings", f"{key}|{MODEL}")):
            assert _stale_status(dev_server, asset, partition) == ("STALE", causes), (asset, partition)
        hold.rollback()
    runs = _wait(
        lambda: _sensor_runs_done(dev_server, before),
        2 * RUN_TIMEOUT,
        "the sensor's runs (edit)",
        dev_server.proc,
        interval=1.0,
    )
    assert all(r["status"] == "SUCCESS" for r in runs), runs
    for asset, partition in (("documents", key), ("chunks", key), ("embeddings", f"{key}|{MODEL}")):
        assert _stale_status(dev_server, asset, partition) == ("FRESH", []), (asset, partition)

    # Counts: the buckets' latest materializations add up to `status`.
    status = _status_json(dev_server)
    documents = _latest_metadata(dev_server, "documents", BUCKETS)
    chunks = _latest_metadata(dev_server, "chunks", BUCKETS)
    shown_docs = {name: sum(m[name] for _, m in documents.values()) for name in ("documents", "current", "quarantined")}
    print(
        f"\nUI (sum over {len(documents)} buckets): {shown_docs}, chunks="
        f"{sum(m['chunk_count'] for _, m in chunks.values())}; status: documents={status['documents']} "
        f"quarantined_documents={status['quarantined_documents']} coverage={status['coverage']}"
    )
    assert shown_docs["current"] == status["documents"].get("current", 0)
    assert shown_docs["quarantined"] == status["documents"].get("quarantined", 0) == status["quarantined_documents"]
    assert shown_docs["documents"] == shown_docs["current"] + shown_docs["quarantined"]
    dims = dev_server.gql("""{ assetNodeOrError(assetKey: {path: ["embeddings"]}) { ... on AssetNode {
                              partitionKeysByDimension { name partitionKeys } } } }""")["assetNodeOrError"]
    models = next(d["partitionKeys"] for d in dims["partitionKeysByDimension"] if d["name"] == "model")
    for model in models:
        cells = _latest_metadata(dev_server, "embeddings_", [f"{k}|{model}" for k in BUCKETS])
        shown = (sum(m["ready"] for _, m in cells.values()), sum(m["chunks"] for _, m in cells.values()))
        cov = status["coverage"][model]
        assert shown == (cov["ready"], cov["wanted"]), (model, shown, cov)
    assert sum(m["chunk_count"] for _, m in chunks.values()) == status["coverage"][MODEL]["wanted"]
