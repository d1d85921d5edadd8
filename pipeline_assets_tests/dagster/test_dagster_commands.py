"""Dagster's own commands from the project root: `dagster asset materialize`, `dagster job launch`,
`dagster job execute` (`dagster dev`: test_dagster_dev_command.py, a module of its own so that the
two long tests run in parallel processes).

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
import subprocess
import sys
import tempfile

import dagster as dg
import pytest
import yaml
from dagster._core.instance.ref import InstanceRef

from pipeline_assets.cli import dagster_instance
from pipeline_assets.cli.dagster_instance import DAGSTER_URL_ENV
from pipeline_assets.defs.models import instance_setup
from pipeline_assets.defs.partitions import bucket_index
from pipeline_assets.store import reports
from pipeline_assets_tests.conftest import FAKE_MODEL
from pipeline_assets_tests.dagster_helpers import bucket_of, latest_data_versions, latest_materializations
from pipeline_assets_tests.dagster_instances import DAGSTER, command_env
from pipeline_assets_tests.data_helpers import bucket_states
from pipeline_assets_tests.processes import REPO, cli

# Each test starts several Dagster processes (each imports Dagster: tens of seconds on a loaded
# machine): a generous deadline against a hang.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def setup(env, clean_db, tmp_path):
    with command_env(env, tmp_path) as prepared:
        yield prepared


def _exports(stdout: str) -> dict[str, str]:
    """The variables of `export NAME=value` lines, as a POSIX shell's eval sets them."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            out[name] = shlex.split(value)[0]
    return out


def test_the_root_dagster_yaml_holds_shared_settings_and_no_storage(monkeypatch):
    """Without DAGSTER_HOME, Dagster's CLI reads ./dagster.yaml: the root has one (run queue, pools,
    retention, telemetry) that needs no environment, and PostgreSQL storage stays in deploy/."""
    monkeypatch.delenv(DAGSTER_URL_ENV, raising=False)
    root_yaml = REPO / "dagster.yaml"
    assert root_yaml.is_file() and (REPO / "deploy" / "dagster.yaml").exists()
    assert "storage" not in yaml.safe_load(root_yaml.read_text())
    # What `dagster dev` / `dagster asset materialize` build when DAGSTER_HOME is unset.
    with (
        tempfile.TemporaryDirectory() as home,
        dg.DagsterInstance.from_ref(InstanceRef.from_dir(home, config_dir=str(REPO))) as instance,
    ):
        assert type(instance.run_storage).__name__ == "SqliteRunStorage"
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        concurrency = instance.get_concurrency_config()  # what the run queue daemon reads
        assert concurrency.run_queue_config.max_concurrent_runs == 4
        assert concurrency.pool_config.default_pool_limit == 1
        assert instance.telemetry_enabled is False
    # `pipeline-assets dev` writes the same shared settings under its PostgreSQL storage.
    written = dagster_instance.instance_yaml()
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
    assert len({bucket_of(d) for d in docs}) == 3  # one document per bucket (the buckets are a hash)
    printed = cli("dagster-env", env=run_env)
    exported = _exports(printed.stdout)
    assert {
        "DAGSTER_HOME",
        DAGSTER_URL_ENV,
        "PIPELINE_HOME",
        "DAGSTER_EVENT_BATCH_SIZE",
        "PIPELINE_PARTITION_BUCKETS",
    } <= set(exported)
    assert exported[DAGSTER_URL_ENV].startswith("postgresql+psycopg2://")
    assert exported["PIPELINE_PARTITION_BUCKETS"] == "64" and "64 document bucket(s)" in printed.stderr
    assert "upgraded" not in printed.stderr

    # The upgrade path: an instance of the per-document scheme (a dynamic partition per document)
    # loses that partition set at the next dagster-env, once; the database is not touched.
    # (Each dagster-env call prepares the instance in a child process that imports Dagster, so
    # this call also checks the bucket count: the database's from now on, another configured
    # count is not exported.)
    assert _legacy_partitions(exported, docs) == docs
    upgraded = cli("dagster-env", env={**run_env, "PIPELINE_PARTITION_BUCKETS": "16"})
    assert "3 per-document partition(s) of the old scheme deleted (nothing re-embedded)" in upgraded.stderr
    # Once: the set is empty now, and a dagster-env on an instance without it says nothing (the
    # first call above), so a third call (another child importing Dagster) would check nothing new.
    assert _exports(upgraded.stdout) == exported and _legacy_partitions(exported) == []
    shell_env = {**run_env, **exported}

    # `dagster job launch` only queues a run (no daemon here): it runs beside the materialization,
    # two Dagster processes at once, as two users of one instance would.
    launch = subprocess.Popen(
        [
            *DAGSTER,
            "job",
            "launch",
            "-w",
            "workspace.yaml",
            "-j",
            "sync_documents",
            "--tags",
            json.dumps({"dagster/partition": bucket_of("doc0002.md")}),
        ],
        env=shell_env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    key = bucket_of("doc0001.md")
    try:
        materialize = subprocess.run(
            [
                *DAGSTER,
                "asset",
                "materialize",
                "-m",
                "pipeline_assets.defs.definitions",
                "--select",
                "documents,chunks",
                "--partition",
                key,
            ],
            env=shell_env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert materialize.returncode == 0, materialize.stderr[-3000:]
        # embeddings are partitioned by bucket x model: the bucket's cell of the configured model's column
        # (dagster-env gave the configured model its column before anything was registered).
        materialize = subprocess.run(
            [
                *DAGSTER,
                "asset",
                "materialize",
                "-m",
                "pipeline_assets.defs.definitions",
                "--select",
                "embeddings",
                "--partition",
                f"{key}|openai/{FAKE_MODEL}",
            ],
            env=shell_env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        _, launch_err = launch.communicate(timeout=300)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
    assert materialize.returncode == 0, materialize.stderr[-3000:]
    assert launch.returncode == 0, launch_err[-3000:]
    root = str(corpus.resolve())
    doc = reports.document_summaries(conn, root, ["doc0001.md"])["doc0001.md"]
    _, cov = reports.embedding_coverage(conn, root, ["doc0001.md"], f"openai/{FAKE_MODEL}")
    assert doc.status == "current" and cov.ready == cov.wanted == doc.chunks
    assert conn.execute("SELECT document_id FROM app.documents").fetchall() == [("doc0001.md",)]  # that bucket only

    # One document by run config (not by partition): the refresh job, as the launchpad runs it.
    config = tmp_path / "refresh.yaml"
    config.write_text(yaml.safe_dump({"ops": {"refresh_documents_op": {"config": {"document_ids": ["doc0000.md"]}}}}))
    refresh = subprocess.run(
        [
            *DAGSTER,
            "job",
            "execute",
            "-m",
            "pipeline_assets.defs.definitions",
            "-j",
            "refresh_documents",
            "-c",
            str(config),
        ],
        env=shell_env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refresh.returncode == 0, refresh.stderr[-3000:]
    refreshed = reports.document_summaries(conn, root, docs)
    assert sorted(refreshed) == ["doc0000.md", "doc0001.md"]  # doc0002's run is only queued
    _, cov0 = reports.embedding_coverage(conn, root, ["doc0000.md"], f"openai/{FAKE_MODEL}")
    assert refreshed["doc0000.md"].status == "current" and cov0.ready == cov0.wanted > 0

    os.environ[DAGSTER_URL_ENV] = exported[DAGSTER_URL_ENV]
    try:
        with dg.DagsterInstance.from_config(exported["DAGSTER_HOME"]) as instance:
            # The same instance `pipeline-assets dev` shows: the bucket's materialization with its own
            # data version (a one-bucket run) and its counts...
            state = bucket_states({"doc0001.md": doc}, [bucket_index(key)], 64)[bucket_index(key)]
            assert latest_data_versions(instance, "documents", [key]) == {key: state.text_digest}
            meta = {
                k: v.value
                for k, v in latest_materializations(instance, "documents", [key])[
                    key
                ].asset_materialization.metadata.items()
            }
            assert (meta["documents"], meta["current"], meta["text_digest"]) == (1, 1, state.text_digest)
            # ...the refreshed document's bucket, materialized by the refresh run and naming it...
            other = bucket_of("doc0000.md")
            for asset in ("documents", "chunks", "embeddings"):
                record = latest_materializations(instance, asset, [other], f"openai/{FAKE_MODEL}")[other]
                assert record.asset_materialization.metadata["refreshed_documents"].value == "doc0000.md"
            # ...and the launched run, queued for the daemon of `dagster dev` / `pipeline-assets dev`.
            (queued,) = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": bucket_of("doc0002.md")}))
            assert queued.job_name == "sync_documents" and queued.status == dg.DagsterRunStatus.QUEUED
    finally:
        os.environ.pop(DAGSTER_URL_ENV, None)


def test_dagster_env_with_no_database_is_one_error_line(setup):
    run_env, _ = setup
    proc = cli(
        "dagster-env", env={**run_env, "PIPELINE_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/x"}, check=False
    )
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error:") and "Traceback" not in proc.stderr


# What `pipeline-assets dev` must not hold while it supervises `dagster dev` (its children import them).
NOT_IN_DEV = ("dagster", "numpy", "onnxruntime", "openai", "tiktoken", "tokenizers")


def test_dev_prepares_the_instance_without_dagster_numpy_or_a_model_runtime(setup):
    """`dev` (and `dagster-env`) prepare the databases and the instance, then only wait on `dagster dev`:
    the modules loaded by then, in a fresh interpreter, hold none of what the Dagster processes use."""
    run_env, _ = setup
    probe = (
        "import json, sys\n"
        "from pipeline_assets.cli.root import main\n"
        "try:\n"
        "    main(['dagster-env'])\n"
        "except SystemExit as exc:\n"
        "    print(json.dumps({'exit': exc.code, 'modules': sorted({n.split('.')[0] for n in sys.modules})}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=run_env, cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert done["exit"] == 0, proc.stderr
    assert "DAGSTER_HOME" in _exports(proc.stdout) and "64 document bucket(s)" in proc.stderr  # it prepared
    assert "psycopg" in done["modules"]  # the probe did connect
    assert not set(done["modules"]) & set(NOT_IN_DEV), sorted(set(done["modules"]) & set(NOT_IN_DEV))
