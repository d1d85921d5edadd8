"""Helpers shared by the test_dagster_* modules (not fixtures: plain functions)."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import psycopg
from dagster._core.definitions.data_version import DATA_VERSION_TAG, CachingStaleStatusResolver

# What the sensor daemon wraps an evaluation in, so partition keys resolve against the instance.
from dagster._core.definitions.partitions.context import partition_loading_context
from dagster._core.loader import LoadingContextForTest

from pipeline_assets.app import buckets as bk
from pipeline_assets.cli import dagster_instance
from pipeline_assets.defs.definitions import build_definitions
from pipeline_assets.defs.partitions import MODEL_PARTITIONS_NAME, bucket_key, embedding_key
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.settings import Settings
from pipeline_assets.store import bucket_rows, migrations, reports
from pipeline_assets_tests.data_helpers import write_corpus


def fresh_defs() -> dg.Definitions:
    """Definitions built from the (monkeypatched) environment of the test."""
    return build_definitions()


def evaluate_sensor(
    sensor: dg.SensorDefinition,
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    cursor: str | None = None,
    *,
    record_events: bool = False,
):
    """One tick as the daemon runs it: evaluate, then apply the dynamic-partition requests (and,
    ``record_events``, write its asset events to the event log, as the daemon does).

    Returns the SensorExecutionData (run_requests resolved, cursor, skip_message).
    """
    with (
        dg.build_sensor_context(
            instance=instance,
            instance_ref=instance.get_ref(),
            cursor=cursor,
            definitions=defs,
            resources=build_resources(Settings.from_env()),
        ) as context,
        partition_loading_context(dynamic_partitions_store=instance),
    ):
        data = sensor.evaluate_tick(context)
    for request in data.dynamic_partitions_requests or []:
        if isinstance(request, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        else:
            for key in request.partition_keys:
                instance.delete_dynamic_partition(request.partitions_def_name, key)
    if record_events:
        for event in data.asset_events or []:
            instance.report_runless_asset_event(event)
    return data


SYNC_JOB, EMBED_JOB = "sync_documents", "embed_documents"


class PipelineResult:
    """A bucket run as the sensors chain it: ``sync_documents``, then (if it succeeded)
    ``embed_documents`` over the same buckets x the configured model. Reads like one
    ExecuteInProcessResult: success of both, events of both, a node's data from its run."""

    def __init__(self, results: list[dg.ExecuteInProcessResult]) -> None:
        self.results = results

    @property
    def success(self) -> bool:
        return all(r.success for r in self.results)

    @property
    def all_events(self) -> list:
        return [e for r in self.results for e in r.all_events]

    def _owner(self, node: str) -> dg.ExecuteInProcessResult:
        for r in self.results:
            if r.job_def.graph.has_node_named(node):
                return r
        raise KeyError(f"no run of this result has the node {node!r}")

    def asset_materializations_for_node(self, node: str) -> list:
        return self._owner(node).asset_materializations_for_node(node)

    def failure_data_for_node(self, node: str):
        return self._owner(node).failure_data_for_node(node)

    def get_asset_check_evaluations(self) -> list:
        return [e for r in self.results for e in r.get_asset_check_evaluations()]

    def get_asset_materialization_events(self) -> list:
        return [e for r in self.results for e in r.get_asset_materialization_events()]

    @property
    def run_id(self) -> str:
        return self.results[0].run_id


def configured_model() -> str:
    from pipeline_assets.providers import model_id_for

    return model_id_for(Settings.from_env().provider_config())


def embed_keys(tags: dict, partition_key: str | None, model: str) -> tuple[str | None, dict]:
    """The embeddings partition (or range tags) of a bucket partition (or range) x one model."""
    if partition_key is not None:
        return str(embedding_key(partition_key, model)), {}
    start, end = tags["dagster/asset_partition_range_start"], tags["dagster/asset_partition_range_end"]
    return None, {
        **tags,
        "dagster/asset_partition_range_start": str(embedding_key(start, model)),
        "dagster/asset_partition_range_end": str(embedding_key(end, model)),
    }


def embed_range_tags(keys: list[str], models: list[str]) -> dict[str, str]:
    """The tags of an embeddings run over buckets ``keys[0]..keys[-1]`` x models ``models[0]..models[-1]``."""
    return {
        "dagster/asset_partition_range_start": str(embedding_key(keys[0], models[0])),
        "dagster/asset_partition_range_end": str(embedding_key(keys[-1], models[-1])),
    }


def execute(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    request: dg.RunRequest | None = None,
    *,
    job: str | None = None,
    partition_key: str | None = None,
    tags: dict | None = None,
    model: str | None = None,
    run_config: dict | None = None,
):
    """Run a job in-process as the run a RunRequest (or a partition key) describes.

    Without a job (or with a request of ``sync_documents``): the bucket run and the embeddings
    run the ``embed_after_sync`` sensor chains to it, for ``model`` (default: the configured
    one). With a job: that job's run alone."""
    chain = job is None
    if request is not None:
        job = job or request.job_name
        chain = job in (None, SYNC_JOB)
        partition_key = request.partition_key
        tags = {k: v for k, v in request.tags.items() if k != "dagster/partition"}
    tags = tags or {}

    def run(name: str, key: str | None, run_tags: dict) -> dg.ExecuteInProcessResult:
        return defs.resolve_job_def(name).execute_in_process(
            instance=instance, partition_key=key, tags=run_tags, raise_on_error=False, run_config=run_config
        )

    if not chain:
        return run(job or SYNC_JOB, partition_key, tags)
    synced = run(SYNC_JOB, partition_key, tags)
    if not synced.success:
        return PipelineResult([synced])
    model = model or configured_model()
    if model not in instance.get_dynamic_partitions(MODEL_PARTITIONS_NAME):
        instance.add_dynamic_partitions(MODEL_PARTITIONS_NAME, [model])
    key, embed_tags = embed_keys(tags, partition_key, model)
    return PipelineResult([synced, run(EMBED_JOB, key, embed_tags)])


def served(conn, document_id: str, model_id: str) -> tuple[str, int, int]:
    """(text of its current chunks, chunks, chunks with a vector of the model): what search can find."""
    return conn.execute(
        "SELECT coalesce(string_agg(c.text, '' ORDER BY c.chunk_index), ''), count(c.chunk_index), "
        "count(e.chunk_checksum) FROM app.documents d JOIN app.chunks c USING (doc_pk) "
        "LEFT JOIN app.embeddings e ON e.chunk_checksum = c.chunk_checksum AND e.model_id = %s "
        "WHERE d.document_id = %s AND d.status = 'current'",
        (model_id, document_id),
    ).fetchone()


def requested_keys(instance: dg.DagsterInstance, request: dg.RunRequest, bucket_count: int = 64) -> list[str]:
    """The bucket keys a run request covers (one key, or a range in partition order)."""
    if request.partition_key:
        return [request.partition_key]
    order = [bucket_key(i) for i in range(bucket_count)]
    start = order.index(request.tags["dagster/asset_partition_range_start"])
    end = order.index(request.tags["dagster/asset_partition_range_end"])
    return order[start : end + 1]


def bucket_of(document_id: str, bucket_count: int = 64) -> str:
    """The partition key of a document's bucket."""
    from pipeline_assets.app.buckets import bucket_of as index

    return bucket_key(index(document_id, bucket_count))


def materialization_metadata(result: dg.ExecuteInProcessResult, asset: str) -> dict:
    """Metadata values (plain Python) of the first materialization of an asset in a result."""
    events = result.asset_materializations_for_node(asset)
    return {k: v.value for k, v in events[0].metadata.items()}


def check_results(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def asset_keys_of(asset: str, keys: list[str], model: str | None = None) -> dict[str, str]:
    """{key as given: the asset's partition key}: a bucket key of ``embeddings`` means that
    bucket x ``model`` (default: the configured model); any other key is itself."""
    if asset != "embeddings":
        return {k: k for k in keys}
    return {k: k if "|" in k else str(embedding_key(k, model or configured_model())) for k in keys}


def latest_materializations(
    instance: dg.DagsterInstance, asset: str, keys: list[str], model: str | None = None
) -> dict[str, dg.EventLogRecord]:
    """The latest materialization record of each partition (keyed as given: ``asset_keys_of``),
    read from the instance's event log."""
    mapped = asset_keys_of(asset, keys, model)
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=list(mapped.values())),
        limit=10 * len(keys) + 10,
        ascending=False,
    ).records
    back = {v: k for k, v in mapped.items()}
    latest: dict[str, dg.EventLogRecord] = {}
    for record in records:
        latest.setdefault(back[record.partition_key], record)
    return latest


def latest_data_versions(
    instance: dg.DagsterInstance, asset: str, keys: list[str], model: str | None = None
) -> dict[str, str]:
    """Each partition's data version as the UI shows it: the tag of its latest materialization."""
    return {
        k: (r.asset_materialization.tags or {}).get(DATA_VERSION_TAG)
        for k, r in latest_materializations(instance, asset, keys, model).items()
    }


def stale_status(
    defs: dg.Definitions, instance: dg.DagsterInstance, asset: str, keys: list[str], model: str | None = None
) -> dict[str, str]:
    """Dagster's own staleness verdict (what the UI shows: FRESH, STALE, MISSING) for some partitions
    (keyed as given: a bucket key of ``embeddings`` is that bucket x ``model``, ``asset_keys_of``)."""
    resolver = CachingStaleStatusResolver(
        instance, defs.get_repository_def().asset_graph, LoadingContextForTest(instance)
    )
    return {k: resolver.get_status(dg.AssetKey(asset), v).value for k, v in asset_keys_of(asset, keys, model).items()}


def stale_causes(
    defs: dg.Definitions, instance: dg.DagsterInstance, asset: str, key: str, model: str | None = None
) -> list:
    """Why Dagster calls a partition stale (the UI's "stale" tooltip)."""
    resolver = CachingStaleStatusResolver(
        instance, defs.get_repository_def().asset_graph, LoadingContextForTest(instance)
    )
    return list(resolver.get_stale_causes(dg.AssetKey(asset), asset_keys_of(asset, [key], model)[key]))


def range_tags(keys: list[str]) -> dict[str, str]:
    """The tags of a run over a partition range (what sensors and single-run backfills launch)."""
    return {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[-1]}


# One migrated Dagster storage database per server and test process, copied for each instance:
# CREATE DATABASE ... TEMPLATE copies files (a fraction of a second), where Dagster creating its
# ~40 tables and indexes in a fresh database took 3-5 s per test.
_TEMPLATES: dict[str, str] = {}


def _dagster_template(server_url: str) -> str:
    if server_url not in _TEMPLATES:
        name = "t_dagster_template_" + uuid.uuid4().hex[:8]
        url = migrations.ensure_database(server_url, name)
        with tempfile.TemporaryDirectory() as home, _instance_env(url):
            (Path(home) / "dagster.yaml").write_text(dagster_instance.instance_yaml())
            dg.DagsterInstance.from_config(home).dispose()  # creates (and stamps) Dagster's schema
        _TEMPLATES[server_url] = name
        atexit.register(_drop_database, server_url, name)
    return _TEMPLATES[server_url]


def _drop_database(server_url: str, name: str) -> None:
    # An embedded server may be stopped already.
    with contextlib.suppress(psycopg.Error), psycopg.connect(server_url, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def _instance_env(url: str) -> Iterator[None]:
    saved = os.environ.get(dagster_instance.DAGSTER_URL_ENV)
    os.environ[dagster_instance.DAGSTER_URL_ENV] = dagster_instance.sqlalchemy_url(url)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(dagster_instance.DAGSTER_URL_ENV, None)
        else:
            os.environ[dagster_instance.DAGSTER_URL_ENV] = saved


def copy_of_dagster_template(server_url: str) -> str:
    """A new database (its name) that holds Dagster's schema and nothing else; the caller drops it."""
    name = "t_dagster_" + uuid.uuid4().hex[:8]
    template = _dagster_template(server_url)
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return name


def _engines(instance: dg.DagsterInstance) -> list:
    """The SQLAlchemy engines of an instance's storages (a `storage: postgres` instance wraps
    dagster-postgres' three storages in legacy adapters)."""
    found = []
    for storage in (instance.event_log_storage, instance.run_storage, instance.schedule_storage):
        inner = getattr(storage, "_storage", None)
        for candidate in (
            storage,
            getattr(inner, "event_log_storage", None),
            getattr(inner, "run_storage", None),
            getattr(inner, "schedule_storage", None),
        ):
            engine = getattr(candidate, "_engine", None)
            if engine is not None and engine not in found:
                found.append(engine)
    return found


# The in-process runs of a test capture no step output: the instance's default (local) compute-log
# manager mirrors each step's stdout and stderr through a `tail -F` and a Python watcher process
# (four processes per step, in the test's own process tree). What the tests assert is in the event
# log and the database, not in the captured output.
NO_COMPUTE_LOGS = """
compute_logs:
  module: dagster._core.storage.noop_compute_log_manager
  class: NoOpComputeLogManager
"""


@contextmanager
def postgres_instance(server_url: str) -> Iterator[dg.DagsterInstance]:
    """A Dagster instance on PostgreSQL storage (a fresh database), configured as `pipeline-assets dev`
    does but for compute logs (none).

    SQLite storage writes each event in its own transaction: a range run of a few
    hundred partitions takes minutes there against seconds on PostgreSQL. The fresh
    database is a copy of a template that holds Dagster's schema and nothing else.
    """
    name = copy_of_dagster_template(server_url)
    url = psycopg.conninfo.make_conninfo(server_url, dbname=name)
    with tempfile.TemporaryDirectory() as home:
        (Path(home) / "dagster.yaml").write_text(dagster_instance.instance_yaml() + NO_COMPUTE_LOGS)
        with _instance_env(url):
            instance = dg.DagsterInstance.from_config(home)
            # Pooled connections, as dagster-webserver holds them (`optimize_for_webserver`; no
            # statement timeout here): dagster-postgres otherwise opens a new connection, a new
            # server backend, for every event it stores and every read (~950 in a test of four
            # 64-bucket runs, a fifth of its time). What a run stores is the same either way.
            instance.optimize_for_webserver(statement_timeout=0, pool_recycle=3600, max_overflow=20)
            try:
                yield instance
            finally:
                instance.dispose()
                for engine in _engines(instance):
                    engine.dispose()  # the pooled connections, closed before the database is dropped
                with psycopg.connect(server_url, autocommit=True) as admin:
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# Dagster's own command line, as a user runs it from the project root.
DAGSTER = [sys.executable, "-W", "ignore", "-m", "dagster"]


@contextmanager
def command_env(env: dict, tmp_path: Path) -> Iterator[tuple[dict, Path]]:
    """(environment, corpus) for Dagster's own commands: the test's settings without any DAGSTER_
    variable, a corpus of 3 documents watched by the sensors, and a Dagster storage database name
    (created by `dagster-env`/`dev` when used; dropped afterwards)."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 3)
    dagster_db = "t_dagster_" + uuid.uuid4().hex[:8]
    run_env = {k: v for k, v in env.items() if not k.startswith("DAGSTER_")}
    run_env.update({"PIPELINE_SOURCE_DIR": str(corpus), "PIPELINE_DAGSTER_DATABASE": dagster_db})
    try:
        yield run_env, corpus
    finally:
        _drop_database(env["PIPELINE_DATABASE_URL"], dagster_db)


def watched_corpus(root: Path, documents: int, monkeypatch) -> Path:
    """A corpus of ``documents`` files at ``root``, made the directory the sensors and assets watch."""
    write_corpus(root, documents)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    return root


def bucket_states(
    summaries: dict[str, reports.DocumentSummary], buckets: Sequence[int], n: int
) -> dict[int, bucket_rows.BucketState]:
    """Each bucket's state computed in Python from its documents' summaries (every bucket asked
    for, empty or not): the oracle ``bucket_rows.states_of`` (one grouped query) must agree with."""
    members: dict[int, list[reports.DocumentSummary]] = {b: [] for b in buckets}
    for doc in sorted(summaries):
        s = summaries[doc]
        if s.status != "deleted":
            members.setdefault(bk.bucket_of(doc, n), []).append(s)
    states = {}
    for bucket, docs in members.items():
        quarantined = [s.document_id for s in docs if s.status == "quarantined"]
        states[bucket] = bucket_rows.BucketState(
            documents=len(docs),
            current=sum(s.status == "current" for s in docs),
            quarantined=len(quarantined),
            chunks=sum(s.chunks for s in docs),
            tokens=sum(s.tokens for s in docs),
            text_digest=bucket_rows.digest(
                f"{s.document_id}={s.text_checksum or f'{s.status}:{s.error_class}'}" for s in docs
            ),
            chunks_digest=bucket_rows.digest(f"{s.document_id}={s.chunks_digest}" for s in docs),
            quarantined_ids=quarantined[: bucket_rows.SAMPLE_IDS],
        )
    return states
