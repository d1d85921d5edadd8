"""Dagster's own commands from the project root: `dagster dev`, `dagster asset materialize`, `dagster job launch`.

Real subprocesses with the real test database and the fake OpenAI server, as a
Dagster user types them: first on a fresh checkout (no DAGSTER_HOME: Dagster's
temporary local storage), then with `pipeline-assets dagster-env` (the instance
`pipeline-assets dev` uses, in PostgreSQL on the same server).
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
from dagster._core.instance.ref import InstanceRef

from pipeline_assets.app import reports
from pipeline_assets.defs.devserver import DAGSTER_URL_ENV
from pipeline_assets_tests.conftest import REPO, cli, write_corpus
from pipeline_assets_tests.dagster_helpers import latest_data_versions

DAGSTER = [sys.executable, "-W", "ignore", "-m", "dagster"]


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


def test_no_instance_config_at_the_root_needs_the_environment(monkeypatch):
    """Without DAGSTER_HOME, Dagster's CLI reads ./dagster.yaml: the root has none that needs PostgreSQL."""
    monkeypatch.delenv(DAGSTER_URL_ENV, raising=False)
    assert not (REPO / "dagster.yaml").exists() and (REPO / "deploy" / "dagster.yaml").exists()
    with tempfile.TemporaryDirectory() as home:
        # What `dagster dev` / `dagster asset materialize` build when DAGSTER_HOME is unset.
        with dg.DagsterInstance.from_ref(InstanceRef.from_dir(home, config_dir=str(REPO))) as instance:
            assert type(instance.run_storage).__name__ == "SqliteRunStorage"


def test_dagster_env_then_asset_materialize_and_job_launch(setup, conn, fake):
    run_env, corpus = setup
    printed = cli("dagster-env", env=run_env)
    exported = _exports(printed.stdout)
    assert {"DAGSTER_HOME", DAGSTER_URL_ENV, "PIPELINE_HOME", "DAGSTER_EVENT_BATCH_SIZE"} <= set(exported)
    assert exported[DAGSTER_URL_ENV].startswith("postgresql+psycopg2://")
    assert "3 new partition(s) registered" in printed.stderr
    shell_env = {**run_env, **exported}

    materialize = subprocess.run(
        [*DAGSTER, "asset", "materialize", "-m", "pipeline_assets.defs.definitions",
         "--select", "documents*", "--partition", "doc0001.md"],
        env=shell_env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert materialize.returncode == 0, materialize.stderr[-3000:]
    doc = reports.document_summaries(conn, str(corpus.resolve()), ["doc0001.md"])["doc0001.md"]
    _, cov = reports.embedding_coverage(conn, str(corpus.resolve()), ["doc0001.md"], "openai/fake-embed")
    assert doc.status == "current" and cov.ready == cov.wanted == doc.chunks
    assert conn.execute("SELECT count(*) FROM app.documents").fetchone()[0] == 1   # that partition only

    launch = subprocess.run(
        [*DAGSTER, "job", "launch", "-w", "workspace.yaml", "-j", "embed_documents",
         "--tags", json.dumps({"dagster/partition": "doc0002.md"})],
        env=shell_env, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert launch.returncode == 0, launch.stderr[-3000:]

    os.environ[DAGSTER_URL_ENV] = exported[DAGSTER_URL_ENV]
    try:
        with dg.DagsterInstance.from_config(exported["DAGSTER_HOME"]) as instance:
            # The same instance `pipeline-assets dev` shows: the materialization with its data version...
            assert latest_data_versions(instance, "documents", ["doc0001.md"]) == {"doc0001.md": doc.text_checksum}
            # ...and the launched run, queued for the daemon of `dagster dev` / `pipeline-assets dev`.
            (queued,) = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "doc0002.md"}))
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
    """`dagster dev` with no DAGSTER_HOME: temporary local storage, the source sensor's batch run,
    and the UI's GraphQL shows each partition's own data version."""
    run_env, corpus = setup
    port = _free_port()
    before = set(REPO.glob(".tmp_dagster_home_*"))
    log = open(tmp_path / "dagster-dev.log", "w")
    proc = subprocess.Popen([*DAGSTER, "dev", "-w", "workspace.yaml", "-p", str(port)], env=run_env, cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    keys = [f"doc{i:04d}.md" for i in range(3)]
    try:
        runs_q = """{ runsOrError(filter: {tags: [{key: "pipeline/trigger", value: "source_documents"}]}) {
                        ... on Runs { results { status } } } }"""
        runs = _poll(lambda: [r for r in _gql(port, runs_q)["runsOrError"]["results"]
                              if r["status"] in ("SUCCESS", "FAILURE")], 150, proc, "the source sensor's run")
        assert [r["status"] for r in runs] == ["SUCCESS"], runs
        ui = _gql(port, """{ d: assetNodeOrError(assetKey: {path: ["documents"]}) {
                                   ... on AssetNode { dataVersionByPartition(partitions: %s) } }
                             e: assetNodeOrError(assetKey: {path: ["embeddings"]}) {
                                   ... on AssetNode { staleStatusByPartition(partitions: %s) } } }"""
                  % (json.dumps(keys), json.dumps(keys)))
        summaries = reports.document_summaries(conn, str(corpus.resolve()), keys)
        # One run over the 3 partitions, and each shows its own checksum; nothing looks stale.
        assert ui["d"]["dataVersionByPartition"] == [summaries[k].text_checksum for k in keys]
        assert ui["e"]["staleStatusByPartition"] == ["FRESH"] * len(keys)
    finally:
        proc.send_signal(signal.SIGINT)          # dagster dev's own clean shutdown
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        # Its temporary storage: dagster dev removes it on exit, unless a child still writes
        # to it then ("Directory not empty"); what this run created goes.
        for leftover in set(REPO.glob(".tmp_dagster_home_*")) - before:
            shutil.rmtree(leftover, ignore_errors=True)
