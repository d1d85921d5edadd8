"""Helpers shared by the test_dagster_* modules (not fixtures: plain functions)."""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg
from dagster._core.definitions.data_version import DATA_VERSION_TAG, CachingStaleStatusResolver

# What the sensor daemon wraps an evaluation in, so partition keys resolve against the instance.
from dagster._core.definitions.partitions.context import partition_loading_context
from dagster._core.loader import LoadingContextForTest

from pipeline_assets.defs.dagster_config import DEFAULT_PARTITION_BUCKETS
from pipeline_assets.defs.definitions import build_definitions
from pipeline_assets.defs.partitions import MODEL_PARTITIONS_NAME, bucket_key, embedding_key
from pipeline_assets.defs.resources import build_resources
from pipeline_assets.settings import Settings
from pipeline_assets_tests.data_helpers import write_corpus


def configured_buckets() -> int:
    """The bucket count of the test's environment (PIPELINE_PARTITION_BUCKETS, else the product's)."""
    return int(os.environ.get("PIPELINE_PARTITION_BUCKETS", DEFAULT_PARTITION_BUCKETS))


def bucket_keys(bucket_count: int) -> list[str]:
    """Every bucket's partition key, in partition order."""
    return [bucket_key(i) for i in range(bucket_count)]


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


def requested_keys(instance: dg.DagsterInstance, request: dg.RunRequest, bucket_count: int | None = None) -> list[str]:
    """The bucket keys a run request covers (one key, or a range in partition order); buckets of the
    environment's count unless given."""
    if request.partition_key:
        return [request.partition_key]
    order = bucket_keys(bucket_count or configured_buckets())
    start = order.index(request.tags["dagster/asset_partition_range_start"])
    end = order.index(request.tags["dagster/asset_partition_range_end"])
    return order[start : end + 1]


def bucket_of(document_id: str, bucket_count: int | None = None) -> str:
    """The partition key of a document's bucket (of the environment's count unless given)."""
    from pipeline_assets.app.buckets import bucket_of as index

    return bucket_key(index(document_id, bucket_count or configured_buckets()))


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


def watched_corpus(root: Path, documents: int, monkeypatch) -> Path:
    """A corpus of ``documents`` files at ``root``, made the directory the sensors and assets watch."""
    write_corpus(root, documents)
    monkeypatch.setenv("PIPELINE_SOURCE_DIR", str(root))
    return root
