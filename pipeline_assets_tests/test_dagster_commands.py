"""Dagster's own commands from the project root: `dagster dev`, `dagster asset materialize`,
`dagster job launch`, `dagster job execute`.

Real subprocesses with the real test database and the fake OpenAI server, as a
Dagster user types them: first on a fresh checkout (no DAGSTER_HOME: Dagster's
temporary local storage, with the root dagster.yaml's shared settings), then with
`pipeline-assets dagster-env` (the instance `pipeline-assets dev` uses, in
PostgreSQL on the same server). Partitions are document buckets (b000..b063).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import dagster as dg
import psycopg
import pytest
import yaml
from dagster._core.instance.ref import InstanceRef

from pipeline_assets.app import buckets as bk
from pipeline_assets.app import reports
from pipeline_assets.defs import devserver, instance_setup
from pipeline_assets.defs.devserver import DAGSTER_URL_ENV
from pipeline_assets.defs.partitions import bucket_index
from pipeline_assets_tests.conftest import FAKE_MODEL, REPO, cli, stop_group, write_corpus
from pipeline_assets_tests.dagster_helpers import bucket_of, latest_data_versions, latest_materializations

DAGSTER = [sys.executable, "-W", "ignore", "-m", "dagster"]

# Each test starts several Dagster processes (each imports Dagster: tens of seconds on a loaded
# machine): a generous deadline against a hang.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def setup(env, clean_db, tmp_path):
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 3)
    dagster_db = "t_dagster_" + uuid.uuid4().hex[:8]
    run_env = {k: v for k, v in env.items() if not k.startswith("DAGSTER_")}
    run_env.update({"PIPELINE_SOURCE_DIR": str(corpus), "PIPELINE_DAGSTER_DATABASE": dagster_db})
    yield run_env, corpus
    with psycopg.connect(env["PIPELINE_DATABASE_URL"], autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{dagster_db}" WITH (FORCE)')


def _exports(stdout: str) -> dict[str, str]:
    """The variables of `export NAME=value` lines, as a POSIX shell's eval sets them."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export "):].partition("=")
            out[name] = shlex.split(value)[0]
    return out


def test_the_root_dagster_yaml_holds_shared_settings_and_no_storage(monkeypatch):
    """Without DAGSTER_HOME, Dagster's CLI reads ./dagster.yaml: the root has one (run queue, pools,
    retention, telemetry) that needs no environment, and PostgreSQL storage stays in deploy/."""
    monkeypatch.delenv(DAGSTER_URL_ENV, raising=False)
    root_yaml = REPO / "dagster.yaml"
    assert root_yaml.is_file() and (REPO / "deploy" / "dagster.yaml").exists()
    assert "storage" not in yaml.safe_load(root_yaml.read_text())
    with tempfile.TemporaryDirectory() as home:
        # What `dagster dev` / `dagster asset materialize` build when DAGSTER_HOME is unset.
        with dg.DagsterInstance.from_ref(InstanceRef.from_dir(home, config_dir=str(REPO))) as instance:
            assert type(instance.run_storage).__name__ == "SqliteRunStorage"
            assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
            concurrency = instance.get_concurrency_config()   # what the run queue daemon reads
            assert concurrency.run_queue_config.max_concurrent_runs == 4
            assert concurrency.pool_config.default_pool_limit == 1
            assert instance.telemetry_enabled is False
    # `pipeline-assets dev` writes the same shared settings under its PostgreSQL storage.
    written = devserver.instance_yaml()
    assert written.endswith(root_yaml.read_text()) and f"env: {DAGSTER_URL_ENV}" in written


def _legacy_partitions(exported: dict[str, str], keys: list[str] | None = None) -> list[str]:
    """The per-document scheme's dynamic partition set in the dagster-env instance (after adding keys)."""
    os.environ[DAGSTER_URL_ENV] = exported[DAGSTER_URL_ENV]
    try:
        with dg.DagsterInstance.from_config(exported["DAGSTER_HOME"]) as instance:
            if keys:
                instance.add_dynamic_partitions(instance_setup.LEGACY_PARTITIONS_NAME, keys)
            return instance.get_dynamic_partitions(instance_setup.LEGACY_PARTITIONS_NAME)
    finally:
        os.environ.pop(DAGSTER_URL_ENV, None)


def test_dagster_env_then_asset_materialize_and_job_launch(setup, conn, fake, tmp_path):
    run_env, corpus = setup
    docs = [f"doc{i:04d}.md" for i in range(3)]
    assert len({bucket_of(d) for d in docs}) == 3        # one document per bucket (the buckets are a hash)
    printed = cli("dagster-env", env=run_env)
    exported = _exports(printed.stdout)
    assert {"DAGSTER_HOME", DAGSTER_URL_ENV, "PIPELINE_HOME", "DAGSTER_EVENT_BATCH_SIZE",
            "PIPELINE_PARTITION_BUCKETS"} <= set(exported)
    assert exported[DAGSTER_URL_ENV].startswith("postgresql+psycopg2://")
    assert exported["PIPELINE_PARTITION_BUCKETS"] == "64" and "64 document bucket(s)" in printed.stderr
    assert "upgraded" not in printed.stderr
    # The count is the database's from now on: another configured count is not exported.
    assert _exports(cli("dagster-env", env={**run_env, "PIPELINE_PARTITION_BUCKETS": "16"}).stdout)[
        "PIPELINE_PARTITION_BUCKETS"] == "64"

    # The upgrade path: an instance of the per-document scheme (a dynamic partition per document)
    # loses that partition set at the next dagster-env, once; the database is not touched.
    assert _legacy_partitions(exported, docs) == docs
    upgraded = cli("dagster-env", env=run_env)
    assert "3 per-document partition(s) of the old scheme deleted (nothing re-embedded)" in upgraded.stderr
    assert _exports(upgraded.stdout) == exported and _legacy_partitions(exported) == []
    assert "upgraded" not in cli("dagster-env", env=run_env).stderr
    shell_env = {**run_env, **exported}

    key = bucket_of("doc0001.md")
    materialize = subprocess.run(
        [*DAGSTER, "asset", "materialize", "-m", "pipeline_assets.defs.definitions",
         "--select", "documents*", "--partition", key],
        env=shell_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert materialize.returncode == 0, materialize.stderr[-3000:]
    root = str(corpus.resolve())
    doc = reports.document_summaries(conn, root, ["doc0001.md"])["doc0001.md"]
    _, cov = reports.embedding_coverage(conn, root, ["doc0001.md"], f"openai/{FAKE_MODEL}")
    assert doc.status == "current" and cov.ready == cov.wanted == doc.chunks
    assert conn.execute("SELECT document_id FROM app.documents").fetchall() == [("doc0001.md",)]  # that bucket only

    launch = subprocess.run(
        [*DAGSTER, "job", "launch", "-w", "workspace.yaml", "-j", "embed_documents",
         "--tags", json.dumps({"dagster/partition": bucket_of("doc0002.md")})],
        env=shell_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert launch.returncode == 0, launch.stderr[-3000:]

    # One document by run config (not by partition): the refresh job, as the launchpad runs it.
    config = tmp_path / "refresh.yaml"
    config.write_text(yaml.safe_dump({"ops": {"refresh_documents_op": {"config": {"document_ids": ["doc0000.md"]}}}}))
    refresh = subprocess.run(
        [*DAGSTER, "job", "execute", "-m", "pipeline_assets.defs.definitions", "-j", "refresh_documents",
         "-c", str(config)],
        env=shell_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refresh.returncode == 0, refresh.stderr[-3000:]
    refreshed = reports.document_summaries(conn, root, docs)
    assert sorted(refreshed) == ["doc0000.md", "doc0001.md"]          # doc0002's run is only queued
    _, cov0 = reports.embedding_coverage(conn, root, ["doc0000.md"], f"openai/{FAKE_MODEL}")
    assert refreshed["doc0000.md"].status == "current" and cov0.ready == cov0.wanted > 0

    os.environ[DAGSTER_URL_ENV] = exported[DAGSTER_URL_ENV]
    try:
        with dg.DagsterInstance.from_config(exported["DAGSTER_HOME"]) as instance:
            # The same instance `pipeline-assets dev` shows: the bucket's materialization with its own
            # data version (a one-bucket run) and its counts...
            state = bk.bucket_states({"doc0001.md": doc}, [bucket_index(key)], 64)[bucket_index(key)]
            assert latest_data_versions(instance, "documents", [key]) == {key: state.text_digest}
            meta = {k: v.value for k, v in
                    latest_materializations(instance, "documents", [key])[key].asset_materialization.metadata.items()}
            assert (meta["documents"], meta["current"], meta["text_digest"]) == (1, 1, state.text_digest)
            # ...the refreshed document's bucket, materialized by the refresh run and naming it...
            other = bucket_of("doc0000.md")
            for asset in ("documents", "chunks", "embeddings"):
                record = latest_materializations(instance, asset, [other])[other]
                assert record.asset_materialization.metadata["refreshed_documents"].value == "doc0000.md"
            # ...and the launched run, queued for the daemon of `dagster dev` / `pipeline-assets dev`.
            (queued,) = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": bucket_of("doc0002.md")}))
            assert queued.job_name == "embed_documents" and queued.status == dg.DagsterRunStatus.QUEUED
    finally:
        os.environ.pop(DAGSTER_URL_ENV, None)


def test_dagster_env_with_no_database_is_one_error_line(setup):
    run_env, _ = setup
    proc = cli("dagster-env", env={**run_env, "PIPELINE_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/x"},
               check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error:") and "Traceback" not in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gql(port: int, query: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["data"]


def _poll(fn, timeout: float, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dagster dev exited ({proc.returncode}) while waiting for {what}"
        try:
            value = fn()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def test_dagster_dev_from_the_project_root_on_a_fresh_checkout(setup, conn, fake, tmp_path):
    """`dagster dev` with no DAGSTER_HOME: temporary local storage, the source sensor's one run over
    the span of the corpus's buckets, and the UI's GraphQL shows each bucket's own metadata."""
    run_env, corpus = setup
    port = _free_port()
    before = set(REPO.glob(".tmp_dagster_home_*"))
    log = open(tmp_path / "dagster-dev.log", "w")
    proc = subprocess.Popen([*DAGSTER, "dev", "-w", "workspace.yaml", "-p", str(port)], env=run_env, cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    docs = [f"doc{i:04d}.md" for i in range(3)]
    keys = sorted(bucket_of(d) for d in docs)
    try:
        runs_q = """{ runsOrError(filter: {tags: [{key: "pipeline/trigger", value: "source_documents"}]}) {
                        ... on Runs { results { status tags { key value } } } } }"""
        runs = _poll(lambda: [r for r in _gql(port, runs_q)["runsOrError"]["results"]
                              if r["status"] in ("SUCCESS", "FAILURE")], 300, proc, "the source sensor's run")
        assert [r["status"] for r in runs] == ["SUCCESS"], runs
        tags = {t["key"]: t["value"] for t in runs[0]["tags"]}
        first, last = tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]
        assert first <= keys[0] and keys[-1] <= last          # one range over (at least) the corpus's buckets
        assert tags["dagster/run_key"].startswith("sync@g0:3:")
        parts = json.dumps(keys)
        ui = _gql(port, """{ d: assetNodeOrError(assetKey: {path: ["documents"]}) {
                                   ... on AssetNode { dataVersionByPartition(partitions: PARTS)
                                     latestMaterializationByPartition(partitions: PARTS) {
                                       partition metadataEntries { label
                                         ... on TextMetadataEntry { text } ... on IntMetadataEntry { intValue } } } } }
                             e: assetNodeOrError(assetKey: {path: ["embeddings"]}) {
                                   ... on AssetNode { staleStatusByPartition(partitions: PARTS) } } }"""
                  .replace("PARTS", parts))
        summaries = reports.document_summaries(conn, str(corpus.resolve()), docs)
        assert sorted(summaries) == docs and all(s.status == "current" for s in summaries.values())
        # One run over the range: one data version for all its buckets (Dagster records one per
        # result), and each bucket's own digest and counts in its metadata; nothing looks stale.
        versions = ui["d"]["dataVersionByPartition"]
        assert len(set(versions)) == 1 and versions[0].startswith(
            f"range:{bucket_index(last) - bucket_index(first) + 1}:")
        for event in ui["d"]["latestMaterializationByPartition"]:
            meta = {m["label"]: m.get("text", m.get("intValue")) for m in event["metadataEntries"]}
            (doc,) = [d for d in docs if bucket_of(d) == event["partition"]]
            b = bucket_index(event["partition"])
            assert meta["text_digest"] == bk.bucket_states({doc: summaries[doc]}, [b], 64)[b].text_digest
            assert (meta["documents"], meta["current"]) == (1, 1)
        assert ui["e"]["staleStatusByPartition"] == ["FRESH"] * len(keys)
    finally:
        # dagster dev's own clean shutdown (SIGINT), then its whole process group: its code server
        # (and that one's gRPC child) outlive it, re-parented, and ignore SIGTERM.
        stop_group(proc, signal.SIGINT, grace=60)
        log.close()
        # Its temporary storage: dagster dev removes it on exit, unless a child still writes
        # to it then ("Directory not empty"); what this run created goes.
        for leftover in set(REPO.glob(".tmp_dagster_home_*")) - before:
            shutil.rmtree(leftover, ignore_errors=True)
