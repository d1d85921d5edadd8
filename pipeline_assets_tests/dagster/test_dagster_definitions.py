"""The Dagster code location loads, and the instance configuration works on real PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from pipeline_assets.app.runtime import code_versions
from pipeline_assets.cli import dagster_instance
from pipeline_assets.defs.keys import ASSET_KEYS, INGEST_KEYS
from pipeline_assets.defs.resources import PostgresResource, SourceDirectoryResource
from pipeline_assets.settings import Settings
from pipeline_assets.store import migrations
from pipeline_assets_tests.dagster_helpers import fresh_defs
from pipeline_assets_tests.dagster_instances import copy_of_dagster_template
from pipeline_assets_tests.processes import REPO


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch):
    for name in (
        "OPENAI_API_KEY",
        "PIPELINE_EMBEDDING_MODEL",
        "PIPELINE_EXTRACTOR_VERSION",
        "PIPELINE_SOURCE_DIR",
        "PIPELINE_DATABASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)


def test_definitions_load_with_the_lineage_graph(monkeypatch):
    monkeypatch.setenv("PIPELINE_RECONCILE_CRON", "*/5 * * * *")
    defs = fresh_defs()
    dg.Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    graph = repo.asset_graph
    assert set(ASSET_KEYS) <= set(graph.get_all_asset_keys())
    # source_files (observed by the source sensor) is upstream of all three: a source change shows them stale.
    source = dg.AssetKey("source_files")
    assert graph.get(dg.AssetKey("documents")).parent_keys == {source}
    assert graph.get(dg.AssetKey("chunks")).parent_keys == {dg.AssetKey("documents"), source}
    assert graph.get(dg.AssetKey("embeddings")).parent_keys == {dg.AssetKey("chunks"), source}
    assert not graph.get(source).is_materializable
    versions = code_versions(Settings.from_env())
    buckets = [f"b{i:03d}" for i in range(64)]
    for key in ASSET_KEYS:
        node = graph.get(key)
        assert node.backfill_policy == dg.BackfillPolicy.single_run()
        assert node.code_version == versions[key.path[-1]]
    for key in INGEST_KEYS:
        assert graph.get(key).partitions_def.get_partition_keys() == buckets
    # embeddings: bucket x model, the model a dynamic dimension (its keys: the registry's active models).
    embeddings = graph.get(dg.AssetKey("embeddings")).partitions_def
    assert isinstance(embeddings, dg.MultiPartitionsDefinition)
    dims = {d.name: d.partitions_def for d in embeddings.partitions_defs}
    assert dims["bucket"].get_partition_keys() == buckets
    assert isinstance(dims["model"], dg.DynamicPartitionsDefinition) and dims["model"].name == "model"
    mapping = graph.get_partition_mapping(dg.AssetKey("embeddings"), dg.AssetKey("chunks"))
    assert isinstance(mapping, dg.MultiToSingleDimensionPartitionMapping)
    assert mapping.partition_dimension_name == "bucket"
    assert versions["documents"] == "extract-1"
    assert versions["embeddings"] == "vectors-1"  # not the model: the model is a partition
    assert repo.get_job("sync_documents").asset_layer.executable_asset_keys == set(INGEST_KEYS)
    assert repo.get_job("embed_documents").asset_layer.executable_asset_keys == {dg.AssetKey("embeddings")}
    # The source sensor's run after a change: its sync, then its embeddings (holding the pool), one run.
    sync_and_embed = repo.get_job("sync_and_embed")
    assert [n.name for n in sync_and_embed.graph.nodes_in_topological_order] == ["sync_pending", "embed_synced"]
    assert sync_and_embed.graph.node_named("embed_synced").definition.pool == "embedding_worker"
    assert sync_and_embed.partitions_def.get_partition_keys() == buckets
    for job in (
        "sync_documents",
        "sync_and_embed",
        "embed_documents",
        "reconcile_job",
        "pipeline_health",
        "refresh_documents",
        "__ASSET_JOB",
    ):
        assert repo.get_job(job).executor_def.name == "in_process", job
    assert {s.name for s in repo.sensor_defs} >= {
        "source_documents",
        "rerun_stale_documents",
        "embed_after_sync",
        "model_switch",
        "reconcile_on_dead_letters",
        "reconcile_on_run_failure",
    }
    schedules = {s.name: s for s in repo.schedule_defs}
    assert schedules["reconcile_hourly"].cron_schedule == "*/5 * * * *"
    # Reconciliation is an asset (not partitioned: it spans every source), run by reconcile_job.
    assert schedules["reconcile_hourly"].job_name == "reconcile_job"
    assert repo.get_job("reconcile_job").asset_layer.executable_asset_keys == {dg.AssetKey("reconciliation")}
    assert graph.get(dg.AssetKey("reconciliation")).partitions_def is None
    # In-process embedding (the default) runs in the concurrency pool.
    assert graph.get(dg.AssetKey("embeddings")).assets_def.op.pool == "embedding_worker"
    checks = {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys}
    assert checks == {
        ("embeddings", "partition_embedded"),
        ("embedding_store", "no_stale_vector_current"),
        ("embedding_store", "dead_letter_growth"),
    }
    # documents and chunks: one step that cannot be subset; the store is not materialized by Dagster.
    ingest = graph.get(dg.AssetKey("documents")).assets_def
    assert ingest is graph.get(dg.AssetKey("chunks")).assets_def and not ingest.can_subset
    assert not graph.get(dg.AssetKey("embedding_store")).is_materializable


def test_model_and_versions_follow_the_environment(monkeypatch):
    monkeypatch.setenv("PIPELINE_EXTRACTOR_VERSION", "extract-9")
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    monkeypatch.setenv("PIPELINE_EMBEDDING_MODEL", "text-embedding-3-large")
    graph = fresh_defs().get_repository_def().asset_graph
    assert graph.get(dg.AssetKey("documents")).code_version == "extract-9"
    assert graph.get(dg.AssetKey("embeddings")).code_version == "vectors-1"  # the same for every model


def test_resources_resolve_like_the_cli(monkeypatch, tmp_path):
    # The embedded server, as db.database_url().
    assert PostgresResource.from_settings(Settings.from_env()).database_url is None
    monkeypatch.setenv("PIPELINE_DATABASE_URL", "postgresql://u@h/db")
    resource = PostgresResource.from_settings(Settings.from_env())
    assert resource.database_url == dg.EnvVar("PIPELINE_DATABASE_URL")  # the UI shows the name, not the URL
    assert resource.url() == "postgresql://u@h/db"
    with dg.build_resources({"postgres": resource}) as built:
        assert built.postgres.url() == "postgresql://u@h/db"
    assert SourceDirectoryResource().root_path() == (REPO / "examples" / "corpus").resolve()
    defs = fresh_defs()
    source, provider = defs.resources["source"], defs.resources["embedding_provider"]
    assert source.root_path() == (REPO / "examples" / "corpus").resolve()
    model = provider.settings().embedding_model
    # The definitions' resources read the settings the definitions were built from, once: not the
    # environment again (a run's resources are built anew from config: the values are its fields).
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(tmp_path))
    monkeypatch.setenv("PIPELINE_EMBEDDING_MODEL", "text-embedding-3-large")
    assert source.root_path() == (REPO / "examples" / "corpus").resolve()
    assert provider.settings().embedding_model == model
    assert type(source)(**source.model_dump()).root_path() == (REPO / "examples" / "corpus").resolve()
    reloaded = fresh_defs()  # a code reload reads the environment again
    assert reloaded.resources["source"].root_path() == tmp_path.resolve()
    assert reloaded.resources["embedding_provider"].settings().embedding_model == "text-embedding-3-large"
    assert source.root_path() == (REPO / "examples" / "corpus").resolve()  # the old definitions' own
    assert SourceDirectoryResource(root="/x/y").root_path() == Path("/x/y")


SECRETS = {
    "PIPELINE_DATABASE_URL": "postgresql://app:pw-db-s3cret@db.example/pipeline",
    "PIPELINE_SOURCE_DATABASE_URL": "postgresql://src:pw-src-s3cret@src.example/docs",
    "OPENAI_API_KEY": "sk-test-key-s3cret",
}


def _shown_config(defs: dg.Definitions) -> str:
    """What the UI shows of each resource's configured values (Dagster's resource snapshot), and
    each resource's own fields, as text."""
    shown = [
        definition.config_schema.default_value_as_json_str
        for definition in defs.get_repository_def().get_top_level_resources().values()
        if definition.config_schema.default_provided
    ]
    fields = {name: resource.model_dump() for name, resource in (defs.resources or {}).items()}
    return "\n".join([*shown, json.dumps(fields, default=str), repr(defs.resources)])


def test_resource_config_names_secrets_never_holds_them(monkeypatch, tmp_path):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    plain = {
        "PIPELINE_EMBEDDING_MODEL": "text-embedding-3-large",
        "PIPELINE_LOCAL_MODEL_DIR": str(tmp_path),
        "PIPELINE_EMBED_RUN_DEADLINE": "12.5",
        "PIPELINE_BATCH_INPUTS": "64",
        "PIPELINE_DECODE_ERRORS": "REPLACE",
    }
    for name, value in plain.items():
        monkeypatch.setenv(name, value)
    defs = fresh_defs()
    shown = _shown_config(defs)
    for value in SECRETS.values():
        assert value not in shown and "s3cret" not in shown
    assert all(name in shown for name in SECRETS)  # the variable's name stands for each secret
    assert "text-embedding-3-large" in shown  # the plain settings are the resource's own values
    provider = defs.resources["embedding_provider"]
    assert provider.settings() == Settings.from_env()  # and resolve back to the settings, secrets included
    assert defs.resources["postgres"].url() == SECRETS["PIPELINE_DATABASE_URL"]


def test_a_resource_rebuilt_from_its_config_in_another_process_reads_its_fields(monkeypatch, tmp_path):
    # A run's resources are built anew from their config, in the run's own process: the values
    # must travel in that config, not in the process that built the definitions.
    monkeypatch.setenv("PIPELINE_EMBEDDING_MODEL", "text-embedding-3-large")
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(tmp_path))
    monkeypatch.setenv("PIPELINE_EMBED_WORKERS", "external")
    resources = fresh_defs().resources
    config = {name: resources[name].model_dump() for name in ("embedding_provider", "source", "embedding_run")}
    script = (
        "import json, sys\n"
        "from pipeline_assets.defs.resources import build_resources\n"
        "from pipeline_assets.settings import Settings\n"
        "config = json.loads(sys.stdin.read())\n"
        "kinds = {name: type(r) for name, r in build_resources(Settings()).items()}\n"
        "built = {name: kinds[name](**value) for name, value in config.items()}\n"
        "print(json.dumps([built['embedding_provider'].settings().embedding_model,\n"
        "                  str(built['source'].root_path()),\n"
        "                  built['embedding_run'].embeds_in_process(Settings())]))\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PIPELINE_EMBEDDING_MODEL", "PIPELINE_SOURCE_DIR", "PIPELINE_EMBED_WORKERS")
    }
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(config),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert json.loads(out) == ["text-embedding-3-large", str(tmp_path.resolve()), False]


def test_a_launchpad_override_keeps_the_configured_secrets(monkeypatch):
    # A run config that sets a field of a resource (the launchpad) replaces all its configured values:
    # the unset ones read the run process's environment, and lose neither the database nor the key.
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    resources = fresh_defs().resources
    seen: dict[str, object] = {}

    @dg.op
    def look(
        postgres: dg.ResourceParam[PostgresResource], embedding_provider: dg.ResourceParam[dg.ConfigurableResource]
    ) -> None:
        seen["url"], seen["key"] = postgres.url(), embedding_provider.settings().openai_api_key

    @dg.job
    def probe() -> None:
        look()

    defs = dg.Definitions(jobs=[probe], resources={k: resources[k] for k in ("postgres", "embedding_provider")})
    run_config = {
        "resources": {
            "postgres": {"config": {"pool_max_size": 2}},
            "embedding_provider": {"config": {"model": "text-embedding-3-small"}},
        }
    }
    assert defs.resolve_job_def("probe").execute_in_process(run_config=run_config).success
    assert seen == {"url": SECRETS["PIPELINE_DATABASE_URL"], "key": SECRETS["OPENAI_API_KEY"]}


def test_workspace_yaml_and_no_tool_dagster_block():
    text = (REPO / "workspace.yaml").read_text()
    assert "pipeline_assets.defs.definitions" in text
    pyproject = (REPO / "pyproject.toml").read_text()
    assert "[tool.dagster]" not in pyproject and "[tool.dg]" not in pyproject


def test_sqlalchemy_url_uses_psycopg2_and_the_socket_dir():
    assert (
        dagster_instance.sqlalchemy_url("postgresql://postgres:@/dagster?host=/tmp/pg/pgdata")
        == "postgresql+psycopg2://postgres@/dagster?host=%2Ftmp%2Fpg%2Fpgdata"
    )
    assert (
        dagster_instance.sqlalchemy_url("postgresql://u:p%40ss@db.example:5433/dagster?sslmode=require")
        == "postgresql+psycopg2://u:p%40ss@db.example:5433/dagster?sslmode=require"
    )


def test_deploy_dagster_yaml_works_on_real_postgres(server_url, tmp_path, monkeypatch):
    """The deployment template deploy/dagster.yaml: storage through dagster-postgres, URL from env."""
    name = "t_dagster_" + uuid.uuid4().hex[:8]
    url = migrations.ensure_database(server_url, name)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "deploy" / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_PG_URL", dagster_instance.sqlalchemy_url(url))
    try:
        instance = dg.DagsterInstance.from_config(str(home))
        try:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
            assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
            # One run at a time embeds in-process: the embedding_worker pool's limit, and the run queue.
            concurrency = instance.get_concurrency_config()
            assert concurrency.pool_config.default_pool_limit == 1
            assert concurrency.run_queue_config.max_concurrent_runs == 4
            assert instance.get_runs_count() == 0
        finally:
            instance.dispose()
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_dev_instance_keeps_its_storage_connections(server_url, tmp_path, monkeypatch):
    """The instance `pipeline-assets dev` writes (daemon, sensors, runs all use it) pools its storages'
    connections as the webserver does: 150 reads and writes open a handful of server sessions, where
    dagster-postgres alone opens one (a PostgreSQL backend, several ms of its CPU) for each."""
    name = copy_of_dagster_template(server_url)
    url = psycopg.conninfo.make_conninfo(server_url, dbname=name)
    (tmp_path / "dagster.yaml").write_text(dagster_instance.instance_yaml())
    monkeypatch.setenv(dagster_instance.DAGSTER_URL_ENV, dagster_instance.sqlalchemy_url(url))

    def sessions() -> int:  # established to the database so far (this one included)
        query = "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        with psycopg.connect(url) as conn:
            return conn.execute(query).fetchone()[0]

    try:
        instance = dg.DagsterInstance.from_config(str(tmp_path))
        try:
            before = sessions()
            for i in range(50):
                instance.add_dynamic_partitions("model", [f"m{i}"])
                assert instance.get_dynamic_partitions("model")[-1] == f"m{i}"
                assert instance.get_runs(limit=1) == []
            opened = sessions() - before
        finally:
            instance.dispose()
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert opened <= 10, f"{opened} sessions for 150 storage calls"


def test_the_bucket_count_follows_the_setting(monkeypatch):
    monkeypatch.setenv("PIPELINE_PARTITION_BUCKETS", "8")
    repo = fresh_defs().get_repository_def()
    graph = repo.asset_graph
    assert repo.get_job("sync_and_embed").partitions_def.get_partition_keys() == [f"b{i:03d}" for i in range(8)]
    for key in INGEST_KEYS:
        assert graph.get(key).partitions_def.get_partition_keys() == [f"b{i:03d}" for i in range(8)]
    dims = {d.name: d.partitions_def for d in graph.get(dg.AssetKey("embeddings")).partitions_def.partitions_defs}
    assert dims["bucket"].get_partition_keys() == [f"b{i:03d}" for i in range(8)]


def test_the_source_sensor_interval_follows_the_setting(monkeypatch):
    def interval() -> int:
        sensors = {s.name: s for s in fresh_defs().get_repository_def().sensor_defs}
        return sensors["source_documents"].minimum_interval_seconds

    monkeypatch.delenv("PIPELINE_SOURCE_SENSOR_INTERVAL", raising=False)
    assert interval() == 30
    monkeypatch.setenv("PIPELINE_SOURCE_SENSOR_INTERVAL", "5")
    assert interval() == 5


def test_no_private_dagster_import_in_the_code():
    """Dagster's public API only: no `dagster._...` import anywhere in pipeline_assets/."""
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "pipeline_assets").rglob("*.py")
        if "dagster._" in p.read_text() or "DagsterEvent" in p.read_text()
    ]
    assert offenders == []


def test_the_root_dagster_yaml_is_what_dev_writes_and_loads_without_storage(tmp_path):
    """The top-level dagster.yaml (what `dagster dev` from the root reads) holds the shared settings;
    `pipeline-assets dev` writes it after its storage section; an installed wheel's copy is the same."""
    import yaml

    root = (REPO / "dagster.yaml").read_text()
    assert "storage" not in yaml.safe_load(root)
    assert yaml.safe_load(root) == yaml.safe_load(dagster_instance.INSTANCE_SETTINGS)
    written = yaml.safe_load(dagster_instance.instance_yaml())
    assert written["storage"]["custom"] == {
        "module": "pipeline_assets.defs.pooled_storage",
        "class": "PooledPostgresStorage",
        "config": {"postgres_url": {"env": dagster_instance.DAGSTER_URL_ENV}},
    }
    (tmp_path / "dagster.yaml").write_text(root)
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    try:
        config = instance.get_concurrency_config()
        assert config.pool_config.default_pool_limit == 1 and config.run_queue_config.max_concurrent_runs == 4
    finally:
        instance.dispose()
